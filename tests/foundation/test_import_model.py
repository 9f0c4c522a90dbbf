"""`stagemesh import-model` / `--model FILE.gguf`: a GGUF file of another architecture than
the default model's (Qwen2, with q/k/v biases), written in the test with the `gguf` package,
imported once into the store and served with the greedy tokens transformers' own GGUF reader
gives, also from Q8_0-quantized weights; an unsupported architecture, or a tensor type the
import cannot dequantize, refused from the header before any tensor is read; a checkpoint
directory whose tensors do not fit its config refused naming the tensor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from foundation.modelstore import ModelError, resolve_model
from foundation.modelstore.imports import import_model, verify_model
from stagemesh.cli import main
from tests.gguf_files import write_tiny_gguf

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STAGEMESH_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_qwen2_gguf_is_imported_once_and_gives_transformers_greedy_tokens(
        home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import transformers

    from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate

    gguf = write_tiny_gguf(tmp_path / "tiny-qwen2.gguf", "qwen2")
    assert main(["import-model", str(gguf)]) == 0
    model_dir = Path(capsys.readouterr().out.strip())
    assert model_dir.parent == home / "models" and model_dir.name.startswith("tiny-qwen2-")
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and verify_model(model_dir).attention_bias
    # the second time, nothing is imported again: the same directory, untouched
    stamp = os.stat(model_dir / "model.safetensors").st_mtime_ns
    assert resolve_model(str(gguf)) == model_dir
    assert os.stat(model_dir / "model.safetensors").st_mtime_ns == stamp

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompts = [[5, 70, 257, 258, 33], [100, 101, 102]]
    want = [hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):]
            .tolist() for p in prompts]
    ours = greedy_generate(LocalPipeline(LocalPipelineConfig(model_dir, 1, block_size=8,
                                                             num_blocks=32)),
                           prompts, max_new_tokens=8)
    assert ours == want


def test_a_q8_0_gguf_gives_the_tokens_of_transformers_dequantized_weights(
        home: Path, tmp_path: Path) -> None:
    import transformers

    from stage_worker.offline import LocalPipeline, LocalPipelineConfig, greedy_generate

    gguf = write_tiny_gguf(tmp_path / "tiny-llama-q8.gguf", "llama", quantization="Q8_0")
    model_dir = import_model(gguf, home)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=gguf.name, dtype=torch.float32).eval()
    prompt = [5, 70, 257, 258, 33]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:]
    ours = greedy_generate(LocalPipeline(LocalPipelineConfig(model_dir, 1, block_size=8,
                                                             num_blocks=32)),
                           [prompt], max_new_tokens=8)
    assert ours == [want.tolist()]


def test_a_tensor_type_the_import_cannot_read_is_refused_naming_it(home: Path,
                                                                   tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny-q8_1.gguf", "llama", quantization="Q8_1")
    with pytest.raises(ModelError, match=r"tensor token_embd.weight is stored as Q8_1, a GGUF "
                                         r"type this import cannot dequantize \(readable: "
                                         r".*Q8_0"):
        import_model(gguf, home)
    assert not (home / "models").exists()  # refused from the header, nothing written


def test_an_unsupported_architecture_is_refused_by_name(home: Path, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny-gemma.gguf", "gemma2")
    with pytest.raises(ModelError, match="GGUF architecture 'gemma2' is not supported"):
        import_model(gguf, home)
    assert not (home / "models").exists()  # refused before anything was written
    with pytest.raises(ModelError, match="not a GGUF file"):
        import_model(tmp_path / "nothing.bin", home)


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_naming_them(
        home: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = import_model(write_tiny_gguf(tmp_path / "t.gguf"), home)
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in model_dir.iterdir():
        if f.name != "stagemesh-import.json":
            (copy / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ModelError) as err:
        import_model(copy, home)
    assert "`model.layers.1.mlp.up_proj.weight` is missing" in str(err.value)
    assert "`model.norm.weight` has shape [65], the config implies [64]" in str(err.value)
