"""`GGMLTypeName`: the type names code uses are real ggml types and behave as the strings they replace."""

from __future__ import annotations

import json

from pipeline.formats.gguf.types import GGMLTypeName, block_geometry, ggml_type


def test_every_name_is_a_ggml_type_with_a_known_block_geometry() -> None:
    for member in GGMLTypeName:
        assert ggml_type(member).name == member.value
        assert block_geometry(member)[0] > 0


def test_a_member_is_its_name_in_comparisons_json_messages_and_lookups() -> None:
    assert GGMLTypeName.Q2_0 == "Q2_0" and {"Q2_0": 1}[GGMLTypeName.Q2_0] == 1
    assert json.dumps({"t": GGMLTypeName.TQ2_0}) == '{"t": "TQ2_0"}'
    assert f"{GGMLTypeName.F16} / {GGMLTypeName.F16!r}" == "F16 / 'F16'"
    assert GGMLTypeName("Q1_0") is GGMLTypeName.Q1_0
