"""``jaxserve plan``: the capacity arithmetic on a synthetic profile, checked
against numbers computed by hand; every budget reported when it binds; the
infeasible cases; the CLI; and a real (small) measurement of ``tiny``.

The synthetic profile, used throughout:

    prefill  256-token chunks: 10000 tokens/s, 512: 12800   -> C = 512, P = 12800
    decode   b=1: 100 tokens/s, b=8: 640, b=32: 1280       -> b_sat = 32
             ITL(1) = 0.01 s, ITL(8) = 0.0125 s, ITL(32) = 0.025 s
             between 8 and 32: D(b) = 640 + (b - 8) x 640/24
    KV       1024 B/token, blocks of 16 tokens = 16384 B; max_model_len 4096 = 256 blocks
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from jaxserve.cli.main import cli
from jaxserve.planning import (
    PlanInfeasible,
    PlanOptions,
    PlanWorkload,
    Profile,
    ProfileError,
    TokenDist,
    WorkloadError,
    build_workload,
    limits_from_results,
    make_plan,
)

GIB = 2**30


def synthetic_profile(**kw) -> Profile:
    fields = dict(
        model="synthetic",
        prefill={256: 10000.0, 512: 12800.0},
        decode={1: 100.0, 8: 640.0, 32: 1280.0},
        kv_bytes_per_token=1024,
        block_size=16,
        weight_bytes=2**26,
        device_memory_bytes=GIB,
        max_model_len=4096,
    )
    fields.update(kw)
    return Profile(**fields)


def workload(rps=20.0, prompt=(128, 256), output=(100, 200), **kw) -> PlanWorkload:
    kw.setdefault("ttft_target_s", 2.0)
    kw.setdefault("headroom", 0.2)
    return PlanWorkload(rps=rps, prompt_tokens=TokenDist(*prompt), output_tokens=TokenDist(*output), **kw)


BIG_KV = PlanOptions(kv_memory_bytes=GIB)  # 65536 blocks


def test_decode_compute_binds_arithmetic():
    p = make_plan(workload(), synthetic_profile(), BIG_KV)
    d = p.derived
    assert d["chunk"] == 512 and d["prefill_tokens_per_s"] == 12800.0
    assert d["b_sat"] == 32 and d["b_itl"] is None
    # a p95 sequence: 256 + 200 = 456 tokens = ceil(28.5) = 29 blocks; floor(65535 / 29) = 2259
    assert d["kv_blocks_budget"] == 65536 and d["blocks_per_p95_sequence"] == 29 and d["b_kv"] == 2259
    assert p.max_num_seqs == 32 and d["b_star_limited_by"] == "decode compute"
    assert d["itl_at_b_star_s"] == pytest.approx(0.025)
    # per job: prefill 128 / 12800 = 0.01 s, decode 100 / 1280 = 0.078125 s
    assert d["prefill_s_per_job"] == pytest.approx(0.01)
    assert d["decode_s_per_job"] == pytest.approx(0.078125)
    # 20 x 0.088125 / 0.8 = 2.203125 -> 3 workers
    assert p.budgets["compute"] == pytest.approx(2.203125)
    assert p.budgets["prefill compute"] == pytest.approx(0.25)
    assert p.budgets["decode compute"] == pytest.approx(1.953125)
    # TTFT: 256 / 12800 = 0.02 s per p95 prompt; floor((2 - 0.025) / 0.02) = 98 per worker; burst 1
    assert d["ttft_burst_prompts_per_worker"] == 98
    assert p.budgets["TTFT"] == pytest.approx(1 / 98)
    assert p.workers == 3
    assert p.binding == "decode compute"
    # KV per worker: max(32 x 29 = 928, 256) + 1 = 929 blocks x 16384 B
    assert p.kv_cache_memory_bytes == 929 * 16384 == 15_220_736
    assert p.max_num_batched_tokens == 512
    assert d["capacity_jobs_per_s_per_worker"] == pytest.approx(1 / 0.088125)
    assert d["capacity_output_tokens_per_s_per_worker"] == pytest.approx(100 / 0.088125)
    assert p.worker_flags == "--max-num-seqs 32 --max-num-batched-tokens 512 --kv-cache-memory 15220736"
    text = p.text()
    assert "20 x 0.088125 / 0.8 = 2.20312" in text
    assert "binding: decode compute" in text


def test_itl_binds():
    p = make_plan(workload(itl_target_s=0.02), synthetic_profile(), BIG_KV)
    # ITL(18) = 18 / (640 + 10 x 640/24) = 0.019853 <= 0.02 < ITL(19) = 19 / 933.33 = 0.020357
    assert p.derived["b_itl"] == 18
    assert p.max_num_seqs == 18 and p.derived["b_star_limited_by"] == "ITL"
    assert p.derived["decode_tokens_per_s_at_b_star"] == pytest.approx(2720 / 3)
    assert p.derived["itl_at_b_star_s"] == pytest.approx(54 / 2720)
    # decode 100 / (2720/3) = 0.110294 s; 20 x 0.120294 / 0.8 = 3.00735 -> 4
    assert p.budgets["compute"] == pytest.approx(25 * (0.01 + 300 / 2720))
    assert p.workers == 4
    assert p.binding == "ITL"
    assert p.kv_cache_memory_bytes == (18 * 29 + 1) * 16384


def test_kv_memory_binds():
    kv = 291 * 16384  # 291 blocks: 290 usable, floor(290 / 29) = 10 sequences
    p = make_plan(workload(), synthetic_profile(), PlanOptions(kv_memory_bytes=kv))
    assert p.derived["kv_blocks_budget"] == 291 and p.derived["b_kv"] == 10
    assert p.max_num_seqs == 10 and p.derived["b_star_limited_by"] == "KV memory"
    # D(10) = 640 + 2 x 640/24 = 2080/3; decode 300 / 2080; 25 x (0.01 + 0.144231) = 3.8558 -> 4
    assert p.derived["decode_tokens_per_s_at_b_star"] == pytest.approx(2080 / 3)
    assert p.budgets["compute"] == pytest.approx(25 * (0.01 + 300 / 2080))
    assert p.workers == 4
    assert p.binding == "KV memory"
    assert p.kv_cache_memory_bytes == kv  # max(10 x 29, 256) + 1 = 291 blocks


def test_prefill_compute_binds():
    w = workload(rps=10.0, prompt=(2560, 3000), output=(10, 20))
    p = make_plan(w, synthetic_profile(), BIG_KV)
    # blocks: ceil(3020 / 16) = 189; floor(65535 / 189) = 346
    assert p.derived["blocks_per_p95_sequence"] == 189 and p.derived["b_kv"] == 346
    # prefill 2560 / 12800 = 0.2 s, decode 10 / 1280; 10 x 0.2078125 / 0.8 = 2.59765625 -> 3
    assert p.budgets["compute"] == pytest.approx(2.59765625)
    assert p.budgets["prefill compute"] == pytest.approx(2.5)
    # TTFT: 3000 / 12800 = 0.234375 s; floor(1.975 / 0.234375) = 8
    assert p.derived["ttft_burst_prompts_per_worker"] == 8
    assert p.workers == 3
    assert p.binding == "prefill compute"


def test_ttft_binds():
    w = workload(rps=10.0, prompt=(500, 1000), output=(100, 200), ttft_target_s=0.5, burst=40)
    p = make_plan(w, synthetic_profile(), BIG_KV)
    # 1000 / 12800 = 0.078125 s per p95 prompt; floor((0.5 - 0.025) / 0.078125) = floor(6.08) = 6
    assert p.derived["ttft_p95_prompt_prefill_s"] == pytest.approx(0.078125)
    assert p.derived["ttft_burst_prompts_per_worker"] == 6
    assert p.budgets["TTFT"] == pytest.approx(40 / 6)
    # compute: 10 x (0.0390625 + 0.078125) / 0.8 = 1.46484375
    assert p.budgets["compute"] == pytest.approx(1.46484375)
    assert p.workers == 7
    assert p.binding == "TTFT"


SCALEOUT = {
    "benchmark": "scaleout",
    "runs": [
        {"workers": 1, "jobs_per_s": 100.0, "broker_cpu_ms_per_job": 2.0, "worker_loop_cpu_ms_per_job": 5.0},
        {"workers": 2, "jobs_per_s": 190.0, "broker_cpu_ms_per_job": 2.5},
        {"workers": 4, "jobs_per_s": 300.0, "broker_cpu_ms_per_job": 2.0},
        {"workers": 8, "jobs_per_s": 310.0, "broker_cpu_ms_per_job": 1.5},
    ],
}


def test_scaleout_limits():
    lim = limits_from_results(SCALEOUT)
    # efficiency 1, 0.95, 0.75, 0.3875: the last one >= 0.75 is N = 4
    assert [e for _, _, e in lim.table] == [1.0, 0.95, 0.75, 0.3875]
    assert lim.workers_per_broker == 4
    assert lim.broker_jobs_per_s_per_core == 500.0  # 1000 / median(2, 2.5, 2, 1.5) ms
    assert lim.loop_cpu_s_per_job == pytest.approx(0.005)
    assert limits_from_results(SCALEOUT, efficiency=0.9).workers_per_broker == 2


def test_worker_event_loop_binds_and_brokers():
    w = workload(rps=500.0, prompt=(16, 32), output=(4, 8), ttft_target_s=None)
    lim = limits_from_results(SCALEOUT)
    p = make_plan(w, synthetic_profile(), PlanOptions(kv_memory_bytes=GIB, scaleout=lim))
    # compute: 500 x (16/12800 + 4/1280) / 0.8 = 2.734375; loop: 500 x 0.005 / 0.8 = 3.125
    assert p.budgets["compute"] == pytest.approx(2.734375)
    assert p.budgets["worker event loop"] == pytest.approx(3.125)
    assert p.workers == 4
    assert p.binding == "worker event loop"
    # brokers: ceil(4 / 4) = 1 by workers; 500 / (0.8 x 500 x 1 core) = 1.25 -> 2
    assert p.brokers == 2
    p2 = make_plan(w, synthetic_profile(), PlanOptions(kv_memory_bytes=GIB, scaleout=lim, broker_cores=2))
    assert p2.brokers == 1  # 500 / (0.8 x 1000) = 0.625 -> 1
    # the event loop also caps a worker's capacity: 1 / 0.005 = 200 jobs/s < 1 / 0.004375
    assert p.derived["capacity_jobs_per_s_per_worker"] == pytest.approx(200.0)


def test_default_kv_memory_from_device():
    p = make_plan(workload(), synthetic_profile(), PlanOptions())
    # int(2**30 x 0.9) - 2**26 = 966367641 - 67108864 = 899258777 B = 54886 blocks of 16384
    assert p.derived["kv_memory_budget_bytes"] == 899_258_777
    assert p.derived["kv_blocks_budget"] == 54_886


def test_chunk_option_and_interpolation():
    prof = synthetic_profile()
    assert (
        make_plan(workload(), prof, PlanOptions(kv_memory_bytes=GIB, chunk=256)).derived["prefill_tokens_per_s"]
        == 10000.0
    )
    # linear between 256 (10000) and 512 (12800)
    assert (
        make_plan(workload(), prof, PlanOptions(kv_memory_bytes=GIB, chunk=384)).derived["prefill_tokens_per_s"]
        == 11400.0
    )
    assert prof.decode_rate(20) == pytest.approx(640 + 12 * 640 / 24)
    assert prof.decode_rate(64) == 1280.0  # flat beyond the largest measured batch


def test_decode_read_at_the_p95_sequence_length():
    # the same rates at context 100, halved at context 1100
    prof = synthetic_profile(decode={100: {1: 100.0, 8: 640.0, 32: 1280.0}, 1100: {1: 50.0, 8: 320.0, 32: 640.0}})
    p = make_plan(workload(), prof, BIG_KV)
    # p95 sequence 256 + 200 = 456 tokens: (456 - 100) / 1000 = 0.356 of the way to 1100
    d32 = 1280 - 0.356 * 640
    assert p.derived["decode_tokens_per_s_at_b_star"] == pytest.approx(d32)
    assert p.budgets["compute"] == pytest.approx(25 * (0.01 + 100 / d32))
    assert p.workers == 3
    assert "Lp95 + Lo95 = 456 tokens" in p.text()
    assert prof.decode_rate(32, 50) == 1280.0 and prof.decode_rate(32, 5000) == 640.0  # flat outside
    assert prof.decode_rate(32) == 640.0  # no context: the longest measured
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


@pytest.mark.parametrize(
    ("w", "opts", "budget"),
    [
        # a p95 prompt alone: 0.025 + 0.078125 > 0.1 s
        (workload(prompt=(500, 1000), ttft_target_s=0.1), BIG_KV, "TTFT"),
        # ITL(1) = 0.01 s > 0.005 s
        (workload(itl_target_s=0.005), BIG_KV, "ITL"),
        # 99 usable blocks cannot hold one request of max_model_len 4096 (256 blocks)
        (workload(), PlanOptions(kv_memory_bytes=100 * 16384), "KV memory"),
        # p95 prompt + output = 456 tokens > max_model_len 400
        (workload(), PlanOptions(kv_memory_bytes=GIB, max_model_len=400), "KV memory"),
    ],
)
def test_infeasible(w, opts, budget):
    with pytest.raises(PlanInfeasible) as info:
        make_plan(w, synthetic_profile(), opts)
    assert info.value.budget == budget


def test_small_kv_with_short_max_model_len():
    # 99 usable blocks hold a 1024-token request (64 blocks); floor(99 / 29) = 3 p95 sequences
    p = make_plan(workload(), synthetic_profile(), PlanOptions(kv_memory_bytes=100 * 16384, max_model_len=1024))
    assert p.max_num_seqs == 3 and p.binding == "KV memory"
    assert p.kv_cache_memory_bytes == (max(3 * 29, 64) + 1) * 16384


def test_workload_parsing(tmp_path):
    assert TokenDist.parse("mean:500,p95:900") == TokenDist(500, 900)
    assert TokenDist.parse("64") == TokenDist(64, 64)
    assert TokenDist.parse({"mean": 3, "p95": 7}) == TokenDist(3, 7)
    for bad in ("p95:900", "mean:x", "mean:-1", "median:3"):
        with pytest.raises(WorkloadError):
            TokenDist.parse(bad)
    with pytest.raises(WorkloadError):
        build_workload(None, rps=1.0, prompt_tokens="10")  # no output tokens
    with pytest.raises(WorkloadError):
        build_workload(None, rps=1.0, prompt_tokens="10", output_tokens="5", headroom=1.0)


def test_profile_validation():
    with pytest.raises(ProfileError):
        Profile.from_dict({"kind": "something else"})
    with pytest.raises(ProfileError):
        synthetic_profile(decode={})
    prof = synthetic_profile()
    assert Profile.from_dict(json.loads(json.dumps(prof.to_dict()))) == prof


def _write_profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    return str(path)


def test_cli_json_matches_arithmetic(tmp_path):
    prof = _write_profile(tmp_path)
    res = CliRunner().invoke(
        cli,
        [
            "plan",
            "--profile",
            prof,
            "--rps",
            "20",
            "--prompt-tokens",
            "mean:128,p95:256",
            "--output-tokens",
            "mean:100,p95:200",
            "--ttft-target-s",
            "2",
            "--itl-target-s",
            "0.02",
            "--headroom",
            "0.2",
            "--kv-memory",
            "1GiB",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["feasible"] is True
    assert (out["workers"], out["max_num_seqs"], out["binding"]) == (4, 18, "ITL")
    assert out["kv_cache_memory_bytes_per_worker"] == (18 * 29 + 1) * 16384
    assert any("b_itl = 18" in line for line in out["lines"])


def test_cli_yaml_workload_and_text(tmp_path):
    prof = _write_profile(tmp_path)
    wl = tmp_path / "w.yaml"
    wl.write_text(
        "rps: 10\nburst: 40\nprompt_tokens: {mean: 500, p95: 1000}\noutput_tokens: {mean: 100, p95: 200}\n"
        "ttft_target_s: 0.5\nheadroom: 0.2\n"
    )
    res = CliRunner().invoke(cli, ["plan", "--profile", prof, "--workload", str(wl), "--kv-memory", "1GiB"])
    assert res.exit_code == 0, res.output
    assert "binding: TTFT" in res.output
    assert "workers = max(1, ceil(1.46484) compute, ceil(6.66667) TTFT) = 7" in res.output
    # a flag overrides the file: burst 1 leaves compute binding
    res = CliRunner().invoke(
        cli, ["plan", "--profile", prof, "--workload", str(wl), "--kv-memory", "1GiB", "--burst", "1"]
    )
    assert "binding: decode compute" in res.output


def test_cli_loadtest_json_as_workload(tmp_path):
    prof = _write_profile(tmp_path)
    lt = tmp_path / "loadtest.json"
    lt.write_text(
        json.dumps(
            [
                {"concurrency": 1, "completed": 0, "prompt_tokens_mean": None},
                {
                    "concurrency": 4,
                    "completed": 9,
                    "prompt_tokens_mean": 128,
                    "prompt_tokens_p95": 256,
                    "output_tokens_mean": 100,
                    "output_tokens_p95": 200,
                },
            ]
        )
    )
    res = CliRunner().invoke(
        cli,
        [
            "plan",
            "--profile",
            prof,
            "--workload",
            str(lt),
            "--rps",
            "20",
            "--ttft-target-s",
            "2",
            "--headroom",
            "0.2",
            "--kv-memory",
            "1GiB",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["workers"] == 3


def test_cli_infeasible_exit_status(tmp_path):
    prof = _write_profile(tmp_path)
    res = CliRunner().invoke(
        cli,
        [
            "plan",
            "--profile",
            prof,
            "--rps",
            "1",
            "--prompt-tokens",
            "10",
            "--output-tokens",
            "10",
            "--itl-target-s",
            "0.001",
            "--json",
        ],
    )
    assert res.exit_code == 2
    assert json.loads(res.output) == {"feasible": False, "budget": "ITL", "message": json.loads(res.output)["message"]}
    res = CliRunner().invoke(cli, ["plan", "--rps", "1", "--prompt-tokens", "10", "--output-tokens", "10"])
    assert res.exit_code == 2 and "--profile" in res.output  # usage error


def test_cli_scaleout_file(tmp_path):
    prof = _write_profile(tmp_path)
    sc = tmp_path / "scaleout.json"
    sc.write_text(json.dumps(SCALEOUT))
    res = CliRunner().invoke(
        cli,
        [
            "plan",
            "--profile",
            prof,
            "--rps",
            "500",
            "--prompt-tokens",
            "mean:16,p95:32",
            "--output-tokens",
            "mean:4,p95:8",
            "--headroom",
            "0.2",
            "--kv-memory",
            "1GiB",
            "--scaleout",
            str(sc),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert (out["workers"], out["binding"], out["brokers"]) == (4, "worker event loop", 2)


def test_measure_tiny_with_the_real_engine(tmp_path):
    """A small real measurement: rates positive, and the KV bytes per token
    of ``tiny`` (2 layers x 2 kv heads x head_dim 16 x keys+values x 4 bytes)."""
    path = tmp_path / "tiny.json"
    res = CliRunner().invoke(
        cli,
        [
            "plan",
            "--measure",
            "--model",
            "tiny",
            "--output",
            str(path),
            "--chunks",
            "16,32",
            "--batches",
            "1,2",
            "--contexts",
            "8,40",
            "--decode-steps",
            "4",
            "--repeats",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    prof = Profile.load(path)
    assert prof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4 == 512
    assert sorted(prof.prefill) == [16, 32] and prof.contexts == [8, 40] and prof.batches == [1, 2]
    rates = [*prof.prefill.values(), *(r for t in prof.decode.values() for r in t.values())]
    assert all(r > 0 and math.isfinite(r) for r in rates)
    assert prof.meta["method"]["temperature"] == 1.0 and prof.meta["engine"]["max_model_len"] == 2048
    assert prof.block_size == 64 and prof.weight_bytes > 0 and prof.max_model_len == 2048
    # the profile plans
    p = make_plan(
        PlanWorkload(rps=1, prompt_tokens=TokenDist(20, 30), output_tokens=TokenDist(8, 8)),
        prof,
        PlanOptions(kv_memory_bytes=64 * 2**20),
    )
    assert p.workers >= 1 and p.max_num_seqs in (1, 2)


def test_unreadable_and_malformed_input_files_are_one_line_errors_naming_the_file(tmp_path):
    from jaxserve.planning import Profile as _Profile
    from jaxserve.planning import ProfileError, ScaleoutError, WorkloadError, load_limits, read_workload_file

    missing, bad = tmp_path / "missing.json", tmp_path / "bad.json"
    bad.write_text("{not json")
    cases = [
        (_Profile.load, ProfileError, "the profile "),
        (load_limits, ScaleoutError, ""),
        (read_workload_file, WorkloadError, "the workload file "),
    ]
    for load, error, what in cases:
        with pytest.raises(error, match=f"^cannot read {what}'{missing}': No such file or directory$"):
            load(missing)
        with pytest.raises(error, match=f"^{bad}: not valid JSON: "):
            load(bad)
