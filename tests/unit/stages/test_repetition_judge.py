"""The repetition check judges token ids and blames the conversion only for what the source does not do.

Regression: with `prompt=Hello` a faithful conversion (top-1 96.3 %, KL 6e-5) was failed because
seven different byte tokens rendered as '\ufffd' looked like "'\ufffd' repeats 7 times", while the
source generated the very same tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.calibration.probe import Backend, ChatReply, Completion, ProbeResult
from pipeline.stages.validate.judge import repetition_check

BYTE_TOKENS = [199, 171, 230, 188, 155, 229, 134]  # seven different byte tokens, each rendering as U+FFFD
BYTES_TEXT = "\ufffd" * 7


def _out(tokens: list[int], text: str, prompt: str = "Hello") -> Completion:
    return Completion(prompt=prompt, text=text, tokens=tuple(tokens))


def _probe(completion: Completion, chat: ChatReply | None = None) -> ProbeResult:
    return ProbeResult(load_s=0.1, n_vocab=256, has_chat_template=chat is not None,
                       completions=(completion,), chat=chat, text=None, backend=Backend(device="cpu"))


def test_distinct_byte_tokens_rendering_as_replacement_chars_are_not_a_loop() -> None:
    same = _out(BYTE_TOKENS, BYTES_TEXT)
    check = repetition_check(_probe(same), _probe(replace(same)))
    assert check.verdict == "pass", check.reason


def test_a_loop_the_source_makes_token_for_token_is_never_the_conversions_fault() -> None:
    looping = _out([5, 9, 5, 9, 5, 9, 5, 9, 5, 9], "ab" * 5)
    chat = ChatReply(prompt="What is 1+1?", text="x" * 8, tokens=(42,) * 8, tokens_source="sampled")
    check = repetition_check(_probe(looping, chat), _probe(replace(looping), replace(chat)))
    assert check.verdict == "warn", check.reason
    assert "the source generates the very same tokens" in check.reason
    assert "not to blame" in check.reason and "broke" not in check.reason
    assert check.numbers is not None and check.numbers["same_as_source"] == ["chat", "completion"]


def test_a_loop_the_source_does_not_make_fails() -> None:
    converted = _out([5, 5, 5, 5, 5, 5], "aaaaaa")
    source = _out([1, 2, 3, 4, 5, 6], "abcdef")
    check = repetition_check(_probe(converted), _probe(source))
    assert check.verdict == "fail"
    assert "token 5 repeats" in check.reason and "the conversion broke it" in check.reason


def test_the_source_looping_differently_on_the_same_prompt_is_a_warning() -> None:
    converted = _out([5, 5, 5, 5, 5, 5], "aaaaaa")
    source = _out([8, 8, 8, 8, 8, 8], "bbbbbb")
    check = repetition_check(_probe(converted), _probe(source))
    assert check.verdict == "warn" and "the source loops too" in check.reason


def test_a_probe_result_round_trips_and_a_malformed_one_names_the_file(tmp_path: Path) -> None:
    from pipeline.calibration.probe import TextRun
    from pipeline.core.errors import IntegrityError

    result = replace(_probe(_out([5, 9], "ab"), ChatReply(prompt="hi", text="2", tokens=(17,))),
                     text=TextRun(tokens=(1, 2, 3), is_truncated=False, eval_s=0.1))
    result.write(tmp_path / "result.json")
    assert ProbeResult.load(tmp_path / "result.json", "converted") == result
    document = result.to_document()
    document["completions"][0]["tokens"] = "many"
    (tmp_path / "broken.json").write_text(json.dumps(document))
    with pytest.raises(IntegrityError, match=r"converted probe result is malformed \(completions\.0\.tokens"):
        ProbeResult.load(tmp_path / "broken.json", "converted")
