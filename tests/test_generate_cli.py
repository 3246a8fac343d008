"""`dayzero-generate`: the embedded default, files of prompts, and rejected lines."""

from __future__ import annotations

import json

from dayzero.serving.cli import main


def test_embedded_default_runs_and_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert main(["--num-prompts", "4", "--max-tokens", "3", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM weights" in printed and "TTFT" in printed and "ITL" in printed and "tokens/s" in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and all(len(r["token_ids"]) == 3 and r["finish_reason"] == "length" for r in rows)
    assert all(r["ttft_s"] > 0 and len(r["itl_s"]) == 2 for r in rows)


def test_jsonl_input_with_a_bad_line(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in [
        {"prompt_token_ids": [5, 6, 7], "max_tokens": 2},
        {"prompt_token_ids": [], "max_tokens": 2},
        {"prompt_token_ids": [9, 9], "max_tokens": 1, "temperature": 0.5, "seed": 3}]) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["--input", str(src), "--output", str(out), "--no-progress", "--no-trim-decode-steps"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [2, 0, 1]
    assert rows[1]["finish_reason"] == "error" and "empty" in rows[1]["error"]
    assert "rejected" in capsys.readouterr().err


def test_empty_input_file_is_a_clear_error(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n")
    assert main(["--input", str(src), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]) == 2
    assert "no prompts" in capsys.readouterr().err
