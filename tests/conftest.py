from __future__ import annotations

import os

import pytest
import torch

from tandem.server.launch import tandem_process
from tests.hf_models import save_model

# The suite runs in pytest-xdist workers (README: `-n auto`, whole files to a worker),
# which share the cores: a worker's torch threads take its share, so that none spins
# on a core another worker's test is using (OpenMP waits by spinning; two workers of
# two threads on 2 cores ran the suite 1.3x slower than one thread each).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, torch.get_num_threads() // _WORKERS)))
WORKER_MEMORY = 4 << 30  # a worker's peak (a model, its transformers reference, servers)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker a core, at most 4 (each test may start servers and ranks of
    its own) and as many as the memory holds."""
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, 4, memory // WORKER_MEMORY))


@pytest.fixture
def two_threads():
    """The compiled kernels' parallel splits (at::parallel_for) run on two threads,
    whatever share of the cores the worker has: the kernel tests use it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


# Test tiers (pytest -m unit | model | system), by module: a module is in the tier of
# its slowest tests.
#   unit    fake token ids, kernels and pure functions: seconds in all
#   model   real forward passes, checked against transformers or brute force
#   system  real processes: servers, the CLI, load generators, multi-instance setups
UNIT = {
    "test_attention", "test_kernels", "test_layering", "test_sampler", "test_scheduler",
    "test_kv_transfer", "test_detokenizer", "test_tokenizer", "test_kv_transfer_params",
    "test_quant", "test_kernel_build", "test_cost_model", "test_simulate", "test_suffix_decoding",
    "test_spec_control", "test_layer_skip", "test_eagle", "test_readme_commands",
    "test_families", "test_docs",
}  # fmt: skip
SYSTEM = {
    "test_server", "test_disagg", "test_bench_serve", "test_cli", "test_readme", "test_trace",
    "test_training", "test_plan", "test_server_hardening", "test_disagg_security",
    "test_openapi_fuzz", "test_engine_process", "test_tool_calls", "test_third_party_clients",
    "test_train_draft", "test_host_memory", "test_tensor_parallel", "test_data_parallel",
    "test_gpu_kernels_interpreted", "test_gpu_kernels_compile", "test_hub", "test_reasoning",
}  # fmt: skip


# The files that take longest (seconds in a clean 2-core run), run first: the
# workers take whole files in collection order, so a long file left to the end keeps one
# worker busy while the others have finished (longest first is the classic schedule).
LONGEST_FIRST = [
    "test_tensor_parallel",  # 175
    "test_disagg",  # 165
    "test_openapi_fuzz",  # 160
    "test_kernels",  # 110
    "test_gemma3_file",  # 100
    "test_plan",  # 95
    "test_cli",  # 80
    "test_disagg_security",  # 70
    "test_gguf",  # 70
    "test_engine_process",  # 65
    "test_data_parallel",  # 55
    "test_train_draft",  # 50 on a worker's one thread: the draft head's training
    "test_training",  # 30
]


def pytest_collection_modifyitems(items):
    def module(item) -> str:
        return item.module.__name__.rsplit(".", 1)[-1]

    for item in items:
        name = module(item)
        tier = "unit" if name in UNIT else "system" if name in SYSTEM else "model"
        item.add_marker(getattr(pytest.mark, tier))
    order = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(module(item), len(order)))  # (stable)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Architecture name -> (folder, transformers model) for one tiny checkpoint each."""
    built = {}

    def get(arch: str, **overrides):
        key = (arch, repr(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"{arch}-model")
            built[key] = (folder, save_model(folder, arch, **overrides))
        return built[key]

    return get


@pytest.fixture(scope="session")
def eagle_heads(tmp_path_factory):
    """Target folder -> the folder of an untrained (random) EAGLE head for it, whose
    draft vocabulary leaves out every fourth token: verification must still produce
    those (eagle_head.py)."""
    import torch

    from tandem.models.loader import read_config
    from tandem.models.random_weights import initialize
    from tandem.spec_decode.eagle_head import EagleHead, save_head

    built = {}

    def get(target) -> str:
        if str(target) not in built:
            _, config, _ = read_config(target)
            vocab = torch.tensor([i for i in range(config.vocab_size) if i % 4 != 3])
            head = EagleHead(config, vocab)
            initialize(head, torch.Generator().manual_seed(0))
            folder = tmp_path_factory.mktemp("eagle-head")
            save_head(head, folder, str(target), training={})
            built[str(target)] = str(folder)
        return built[str(target)]

    return get


@pytest.fixture(scope="session")
def llama_folder(model_dirs) -> str:
    """The tiny random Llama's folder (model_dirs' "llama")."""
    return str(model_dirs("llama")[0])


@pytest.fixture(scope="session")
def tiny_server(model_dirs):
    """`tandem serve` on the tiny random Llama, served as "tiny", trace endpoints on;
    yields its base URL."""
    folder, _ = model_dirs("llama")
    with tandem_process(
        "serve", "--model", str(folder), "--served-model-name", "tiny", "--enable-trace-endpoints"
    ) as url:
        yield url
