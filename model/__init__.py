"""dayzero.model: `ModelConfig`, the Flax modules of the family, checkpoint loading and the `Model` callable."""

from .config import ModelConfig, RopeConfig
from .errors import CheckpointError, ConfigError, DayzeroError, RequestError
from .model import Model, load_checkpoint

__all__ = ["ModelConfig", "RopeConfig", "Model", "load_checkpoint", "ConfigError", "CheckpointError",
           "RequestError", "DayzeroError"]
