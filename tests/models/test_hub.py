"""Reading config.json: ModelOpt's hf_quant_config.json folded in as quantization_config."""

from __future__ import annotations

import json

from freetoken.models import hub


def test_the_quant_file_is_folded_in_only_where_config_names_nothing():
    section = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    folded = hub.with_quant_file({"model_type": "x"}, {"producer": {}, "quantization": section})
    assert folded["quantization_config"] == {"quant_method": "modelopt", **section}
    # some exports write the fields at the top of the file
    assert hub.with_quant_file({}, section)["quantization_config"]["quant_algo"] == "NVFP4"
    own = {"quantization_config": {"quant_method": "fp8"}}
    assert hub.with_quant_file(own, {"quantization": section}) == own
    for junk in (None, [], {"quantization": {"group_size": 16}}, {"quantization": "NVFP4"}):
        assert hub.with_quant_file({"a": 1}, junk) == {"a": 1}


def test_read_config_reads_the_quant_file_beside_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "x"}))
    files = {"config.json": tmp_path / "config.json"}
    assert hub.read_config(files) == {"model_type": "x"}
    (tmp_path / hub.QUANT_FILE).write_text(json.dumps({"quantization": {"quant_algo": "NVFP4"}}))
    files[hub.QUANT_FILE] = tmp_path / hub.QUANT_FILE
    assert hub.read_config(files)["quantization_config"]["quant_method"] == "modelopt"
