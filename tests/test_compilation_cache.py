"""The persistent compilation cache and ``EngineArgs.cache_forward_programs``.

Each case runs in a process of its own: JAX decides once per process where
its cache is and whether it is on.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_BUILD = """
import json, sys
from pathlib import Path
from jaxserve.engine.engine import Engine
from jaxserve.engine.args import EngineArgs
cache, forward = sys.argv[1], sys.argv[2] == "1"
engine = Engine(EngineArgs(model="tiny", max_num_seqs=4, max_model_len=128, compilation_cache_dir=cache,
                           cache_forward_programs=forward))
engine.warmup()
print(json.dumps(sorted({p.name.split("-")[0] for p in Path(cache).iterdir()})))
"""


def _programs_cached(cache_dir, forward: bool) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _BUILD, str(cache_dir), "1" if forward else "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("forward", [True, False])
def test_the_forward_programs_stay_out_of_the_cache_when_asked_and_the_rest_go_in(tmp_path, forward):
    cached = _programs_cached(tmp_path, forward)
    assert "jit__sample_fn" in cached and "jit__greedy_fn" in cached
    assert ("jit__forward_fn" in cached) is forward
