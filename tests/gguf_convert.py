"""llama.cpp's own converter (``convert_hf_to_gguf.py``) for the tests: Hugging Face folder -> GGUF file.

The converter is the one in the vendored llama.cpp tree of the
``llama-cpp-python`` sdist that the benchmarks' llama.cpp peer is built
from (``benchmarks/peers/setup_llamacpp.sh``). Only its Python side is
used (``convert_hf_to_gguf.py``, ``conversion/`` and the ``gguf-py`` it
imports instead of PyPI's), extracted once from the sdist into the cache
(``$JAXSERVE_CACHE_DIR``, default ``~/.cache/jaxserve``); the sdist comes
from PyPI with ``pip download`` (or from ``.peers/llama.cpp/sdist`` when
the peer was set up). Nothing is built.

The converter refuses a byte-level BPE tokenizer whose pre-tokenizer it
does not know (it hashes the ids of a fixed text), so the checkpoints it
converts here carry SmolLM2's tokenizer (:func:`with_smollm2_tokenizer`),
which it knows, and a vocabulary of that size; Gemma 2's converter wants a
SentencePiece ``tokenizer.model`` instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
ROOT = Path(__file__).resolve().parents[1]
#: SmolLM2's vocabulary: a checkpoint with its tokenizer has this many rows
SMOLLM2_VOCAB = 49152


def _cache_dir() -> Path:
    base = os.environ.get("JAXSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxserve")
    return Path(base) / f"llama-cpp-converter-{VERSION}"


def converter_dir() -> Path:
    """The folder holding ``convert_hf_to_gguf.py``, extracted on first use."""
    target = _cache_dir()
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    sdist = ROOT / ".peers" / "llama.cpp" / "sdist" / SDIST
    download = target.parent / f"{target.name}.sdist"
    if not sdist.is_file():
        download.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-binary", "llama-cpp-python", "--no-deps"]
            + ["-d", str(download), f"llama-cpp-python=={VERSION}"],
            check=True,
        )
        sdist = download / SDIST
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
    tmp = target.parent / f"{target.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        members = [
            m for m in tar.getmembers() if m.name.startswith(prefix) and m.name[len(prefix) :].startswith(wanted)
        ]
        for m in members:
            m.name = m.name[len(prefix) :]
        tar.extractall(tmp, members=members, filter="data")
    try:
        tmp.rename(target)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(download, ignore_errors=True)
    return target


def convert(folder: str | os.PathLike, outfile: str | os.PathLike, outtype: str = "f32") -> Path:
    """Run llama.cpp's converter on ``folder``; returns the GGUF path."""
    conv = converter_dir()
    env = {**os.environ, "PYTHONPATH": str(conv / "gguf-py"), "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")
    proc = subprocess.run(
        [sys.executable, str(conv / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(outfile)]
        + ["--outtype", outtype],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return Path(outfile)


def with_smollm2_tokenizer(folder: str | os.PathLike) -> str:
    """Copy SmolLM2's tokenizer files (from the ``smollm2-135m`` preset's
    folder) into a checkpoint folder built with ``vocab_size=SMOLLM2_VOCAB``."""
    from jaxserve.presets import resolve_model

    smol = resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(smol) / name, Path(folder) / name)
    return os.fspath(folder)
