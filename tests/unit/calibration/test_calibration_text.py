"""The built-in calibration text: what it holds, its licence, and that it never contains validation's text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.calibration.text import (
    builtin_text,
    check_disjoint,
    find_shared_run,
    read_calibration_file,
    text_sha256,
)
from pipeline.core.errors import InputError
from pipeline.stages.validate import DEFAULT_AGREEMENT_TEXT, Params

_SPAN_CHARS = 30


def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text.casefold())


def _shared_span(a: str, b: str, length: int) -> str | None:
    spans = {b[i : i + length] for i in range(len(b) - length + 1)}
    return next((a[i : i + length] for i in range(len(a) - length + 1) if a[i : i + length] in spans), None)


def test_builtin_text_shares_nothing_long_with_the_agreement_text() -> None:
    text = builtin_text()
    assert find_shared_run(text, DEFAULT_AGREEMENT_TEXT, 5) is None
    assert _shared_span(_normalised(text), _normalised(DEFAULT_AGREEMENT_TEXT), _SPAN_CHARS) is None
    assert Params().probe.prompt not in text  # "1+1=": the sanity prompt's answer must not be taught
    assert "1+1" not in text.replace(" ", "")


def test_the_span_check_would_notice_a_copy() -> None:
    """The checks above are not vacuous: a sentence of the agreement text inside is found."""
    sentence = DEFAULT_AGREEMENT_TEXT.split(". ")[1]
    spiked = builtin_text() + "\n" + sentence
    assert find_shared_run(spiked, DEFAULT_AGREEMENT_TEXT, 5) is not None
    assert _shared_span(_normalised(spiked), _normalised(DEFAULT_AGREEMENT_TEXT), _SPAN_CHARS) is not None
    with pytest.raises(InputError, match="words of the agreement text"):
        check_disjoint(spiked, DEFAULT_AGREEMENT_TEXT, min_words=8)
    check_disjoint(builtin_text(), DEFAULT_AGREEMENT_TEXT, min_words=5)


def test_builtin_text_mixes_kinds_and_scripts() -> None:
    text = builtin_text()
    assert 12_000 < len(text) < 40_000
    for marker in ("def ", "#include", "SELECT ", '"sensors"', "fn ", "| Month", "Q: ", '"Good morning'):
        assert marker in text, marker
    scripts = {
        "cjk": r"[\u4e00-\u9fff]",
        "kana": r"[\u3040-\u30ff]",
        "hangul": r"[\uac00-\ud7af]",
        "cyrillic": r"[\u0400-\u04ff]",
        "greek": r"[\u0370-\u03ff]",
        "arabic": r"[\u0600-\u06ff]",
        "devanagari": r"[\u0900-\u097f]",
        "latin accents": r"[éèüßñçąłğ]",
    }
    missing = [name for name, pattern in scripts.items() if not re.search(pattern, text)]
    assert not missing
    assert len(re.findall(r"\d+(?:\.\d+)?", text)) > 150  # numbers of many shapes


def test_licence_is_stated_next_to_the_text() -> None:
    readme = Path(__file__).resolve().parents[3] / "pipeline" / "calibration" / "data" / "README.md"
    body = readme.read_text(encoding="utf-8")
    assert "Apache-2.0" in body and "written for Bonsai Pipeline" in body


def test_user_file_is_read_or_refused_with_the_reason(tmp_path: Path) -> None:
    good = tmp_path / "cal.txt"
    good.write_text("Texte de calibration.\n", encoding="utf-8")
    assert read_calibration_file(good) == "Texte de calibration.\n"
    assert text_sha256("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(InputError, match="not UTF-8.*byte 3"):
        read_calibration_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n", encoding="utf-8")
    with pytest.raises(InputError, match="holds no text"):
        read_calibration_file(empty)
    with pytest.raises(InputError, match="does not exist"):
        read_calibration_file(tmp_path / "absent.txt")
