import os

# Before anything imports jax: libtpu and the CUDA plugin are installed (the aot extra) for their compilers, and
# without this JAX would try to start the TPU / CUDA runtimes, which cannot run here. Deviceless compiles
# (tests/test_aot.py) still reach both compilers. A machine with a real accelerator can set JAX_PLATFORMS itself.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu locks the machine for one process; the deviceless TPU compiler drives no chip, so a test run beside another
# process that loaded libtpu (a second pytest, a `plan --compile`) must not fail on that lock.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import pytest  # noqa: E402

# The CLI commands run in-process here: keep them off the user's persistent compilation cache (and keep JAX's
# process-wide cache setting untouched); tests/test_generate_cli.py exercises the cache in subprocesses.
os.environ["KIMI_JAX_COMPILE_CACHE"] = "off"

# XLA:CPU maps about three memory areas per compiled program and keeps every program a test module compiled; a
# long-lived test worker compiles tens of thousands and reaches the kernel's limit of memory maps per process
# (vm.max_map_count, 65530 by default), where the next compile aborts or segfaults. After any module that leaves the
# worker above MAP_LIMIT maps, the compiled programs are dropped (the next module compiles its own anyway).
MAP_LIMIT = 30000


def _map_count() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to watch
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_maps():
    yield
    if _map_count() > MAP_LIMIT:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


# Golden outputs of a reference K3 implementation (float32), kept in the repository: tests/fixtures/k3-tiny-a/README.md.
K3_TINY_A = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "k3-tiny-a")


@pytest.fixture(scope="session")
def k3_tiny_a():
    if not os.path.isdir(K3_TINY_A):
        pytest.fail(f"fixture missing: {K3_TINY_A}")
    return K3_TINY_A


@pytest.fixture(scope="session")
def k3_golden(k3_tiny_a):
    from safetensors.numpy import load_file

    return load_file(os.path.join(k3_tiny_a, "golden.safetensors"))


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    from tests import hf_models

    path = tmp_path_factory.mktemp("hf_llama")
    return str(path), hf_models.llama(path)


@pytest.fixture(scope="session")
def hf_kimi_linear(tmp_path_factory):
    from tests import hf_models

    path = tmp_path_factory.mktemp("hf_kimi_linear")
    return str(path), hf_models.kimi_linear(path)


# The longest test files first: `-n 2 --dist loadfile` hands files to the workers in collection order, so a long
# file collected last (alphabetically) can leave one worker running it alone for minutes; these start first instead
# (seconds on 2 cores, 2026-12-04). Tests inside a file keep their order.
LONGEST_FIRST = ("test_serve_multihost.py", "test_sharding_devices.py", "test_notebooks.py", "test_server.py",
                 "test_offload.py", "test_train_cli.py", "test_scan.py", "test_multihost.py", "test_engine.py",
                 "test_aot_sharded.py", "test_aot.py", "test_train_moe_sharded.py", "test_quantize_model.py",
                 "test_cli_mesh.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.path.name, len(rank)), order[id(it)]))
