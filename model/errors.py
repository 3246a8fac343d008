"""Typed errors. Each names what is wrong: the config field, the tensor, the file or the request."""


class DayzeroError(Exception):
    """Base class of every error dayzero raises on purpose."""


class ConfigError(DayzeroError, ValueError):
    """A config.json (or ModelConfig) field is missing, unknown or inconsistent.

    `field` names the offending field (dotted for nested dicts, e.g. `linear_attn_config.kda_layers`).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.reason = message
        super().__init__(f"config field '{field}': {message}")


class CheckpointError(DayzeroError, OSError):
    """A checkpoint cannot be loaded: unreadable or truncated file, or tensors that do not match the model.

    `problems` lists every problem found (missing, unexpected, shape- or dtype-mismatched tensors), so one
    load attempt reports them all.
    """

    def __init__(self, message: str, problems: list[str] | None = None):
        self.problems = list(problems or [])
        text = message
        if self.problems:
            shown = self.problems[:50]
            more = len(self.problems) - len(shown)
            text += "\n  " + "\n  ".join(shown) + (f"\n  ... and {more} more" if more > 0 else "")
        super().__init__(text)


class RequestError(DayzeroError, ValueError):
    """A single request is invalid (empty prompt, too long, token id out of range, bad sampling parameters).

    `request_id` names the request; the engine rejects it alone and keeps serving the others.
    """

    def __init__(self, request_id: str | int | None, message: str):
        self.request_id = request_id
        super().__init__(f"request {request_id!r}: {message}")


class ImageError(RequestError):
    """An image input is unusable: unreadable or not an image, more patches than allowed, pixel_values that do not
    match image_grid_thw, or a prompt whose image placeholder tokens do not match the images.

    `request_id` names the request (None for a direct `Model` call); the message names the image.
    """
