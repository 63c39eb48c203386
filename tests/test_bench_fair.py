"""bench/fair.py: a rival side runs with its own defaults (none of our OpenMP / MKL
settings), ours as the README says, both on the thread count asked; the ISA header."""

from bench import fair


def test_isa_names_the_vector_extensions():
    assert fair.isa({"avx2"}) == "AVX2"
    assert fair.isa({"avx2", "avx512f"}) == "AVX-512"
    assert fair.isa({"avx512f", "avx512_bf16"}) == "AVX-512 +BF16"
    assert fair.isa({"avx512f", "avx512_bf16", "amx_tile"}) == "AVX-512 +BF16 +AMX"
    assert fair.isa(set()) == "other"


def test_sides_see_their_own_settings_not_ours(monkeypatch):
    # what a bench process (or its caller's shell) may hold
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert not any(k.startswith(fair.TUNING_PREFIXES) for k in fair.clean_env())
    with fair.Side("rival", "bench.fair:EnvProbe", 2) as rival:
        seen = rival.call("report")
    assert seen == {"tuning_env": {}, "threads": 2}  # its defaults, our thread count
    with fair.Side("ours", "bench.fair:EnvProbe", 2) as ours:
        seen = ours.call("report")
    # configure_process("library", 2): the brief spin, and 2 threads
    assert seen["threads"] == 2
    assert "GOMP_SPINCOUNT" in seen["tuning_env"] and seen["tuning_env"]["GOMP_SPINCOUNT"] != "1"
    assert "OMP_WAIT_POLICY" not in seen["tuning_env"]
