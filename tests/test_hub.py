"""Models by Hugging Face id, as a user runs them: `tandem pull`, `tandem generate
--model org/repo`, `tandem models`, in processes of their own, through huggingface_hub's
real client against a stand-in hub on 127.0.0.1 (tests/fake_hub.py, HF_ENDPOINT) and
its real cache (HF_HOME in a temporary folder); offline, from that cache alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.errors import ModelLoadError
from tandem.models.hub import HubId, choose_gguf, gguf_tag, parse_hub_id
from tests.fake_hub import FakeHub, serving

# -- the names, without a hub ----------------------------------------------------------


def test_ids_are_told_from_paths_and_catalog_names(tmp_path, monkeypatch):
    assert parse_hub_id("Qwen/Qwen3-0.6B") == HubId("Qwen/Qwen3-0.6B")
    assert parse_hub_id("org/repo:Q4_K_M") == HubId("org/repo", tag="Q4_K_M")
    assert parse_hub_id("org/repo/sub/m-Q8_0.gguf") == HubId("org/repo", filename="sub/m-Q8_0.gguf")
    for local in ("smollm2-135m-instruct", "./org/repo", "/abs/folder", "a/b/c", "org/repo:"):
        assert parse_hub_id(local) is None, local
    (tmp_path / "org" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)  # an existing path is a path, even when it reads as an id
    assert parse_hub_id("org/repo") is None


def test_a_tag_picks_one_gguf_file_and_says_what_else_there_is():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q8_0.gguf", "mmproj-m-F16.gguf", "m.Q4_0.gguf"]
    assert gguf_tag("m-Q4_K_M.gguf") == "Q4_K_M" and gguf_tag("m.iq4_xs.gguf") == "IQ4_XS"
    assert choose_gguf(HubId("o/r", tag="q8_0"), files) == ["m-Q8_0.gguf"]
    assert choose_gguf(HubId("o/r"), files) == ["m-Q4_K_M.gguf"]  # the default tag
    assert choose_gguf(HubId("o/r"), ["only-Q6_K.gguf"]) == ["only-Q6_K.gguf"]
    with pytest.raises(ModelLoadError, match=r"no Q2_K file \(it offers: Q4_0, Q4_K_M, Q8_0\)"):
        choose_gguf(HubId("o/r", tag="Q2_K"), files)
    with pytest.raises(ModelLoadError, match="several GGUF files; pick one"):
        choose_gguf(HubId("o/r"), ["a-Q4_0.gguf", "a-Q8_0.gguf"])
    split = ["b-Q4_K_M-00001-of-00002.gguf", "b-Q4_K_M-00002-of-00002.gguf"]
    assert choose_gguf(HubId("o/r", tag="Q4_K_M"), [*split, "b-Q8_0.gguf"]) == split
    assert choose_gguf(HubId("o/r", filename=split[1]), split) == split  # any part: all
    with pytest.raises(ModelLoadError, match=r"missing: b-Q4_K_M-00002-of-00002\.gguf"):
        choose_gguf(HubId("o/r", tag="Q4_K_M"), split[:1])


# -- the real client against a stand-in hub ---------------------------------------------


@pytest.fixture(scope="module")
def hub_repos(tmp_path_factory, model_dirs):
    """org/tiny: a model folder (with a README the loader does not need); org/tiny-gguf:
    the same weights as Q8_0 and Q4_0 files and a projector file."""
    from tandem.models.gguf_export import export_gguf

    folder, _ = model_dirs("llama")
    tiny = tmp_path_factory.mktemp("tiny")
    for path in Path(folder).iterdir():
        shutil.copy(path, tiny / path.name)
    (tiny / "README.md").write_text("a model card")
    gguf = tmp_path_factory.mktemp("tiny-gguf")
    export_gguf(folder, gguf / "tiny-Q8_0.gguf", "q8_0")
    export_gguf(folder, gguf / "tiny-Q4_0.gguf", "q4_0")
    (gguf / "mmproj-tiny-F16.gguf").write_bytes(b"not a model")
    split = tmp_path_factory.mktemp("tiny-split")  # llama.cpp's gguf-split naming
    export_gguf(folder, split / "tiny-BF16.gguf", "bf16", split_max_tensors=6)
    return {"org/tiny": tiny, "org/tiny-gguf": gguf, "org/tiny-split": split}, folder


def tandem(home: Path, *args: str, endpoint: str | None = None, offline: bool = False):
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_CACHE", None)
    env["HF_ENDPOINT"] = endpoint or "http://127.0.0.1:9"  # (nothing listens there)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=180,
        env=env,
    )  # fmt: skip


def generate(home: Path, model: str, **kw) -> subprocess.CompletedProcess:
    return tandem(home, "generate", "def main():", "--model", model, "--max-tokens", "6",
                  "--temperature", "0", "--ignore-eos", **kw)  # fmt: skip


def test_a_model_folder_by_id_downloads_what_it_needs_and_runs_offline_after(tmp_path, hub_repos):
    repos, folder = hub_repos
    hub = FakeHub(repos)
    with serving(hub) as url:
        pulled = tandem(tmp_path, "pull", "org/tiny", endpoint=url)
        assert pulled.returncode == 0, pulled.stderr
        local = Path(pulled.stdout.strip().splitlines()[-1])
        assert str(local).startswith(str(tmp_path))  # in the hub's cache
        assert not (local / "README.md").exists()  # only the files the loader reads
        assert {"config.json", "model.safetensors"} <= {p.name for p in local.iterdir()}
        by_id = generate(tmp_path, "org/tiny", endpoint=url)
    assert by_id.returncode == 0, by_id.stderr
    by_path = generate(tmp_path, str(folder))
    assert by_id.stdout == by_path.stdout and by_id.stdout.strip()
    offline = generate(tmp_path, "org/tiny", offline=True)  # the hub is gone too
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == by_path.stdout
    listed = tandem(tmp_path, "models")
    assert "org/tiny" in listed.stdout and "safetensors" in listed.stdout


def test_a_gguf_repository_by_tag(tmp_path, hub_repos):
    repos, _ = hub_repos
    with serving(FakeHub(repos)) as url:
        pulled = tandem(tmp_path, "pull", "org/tiny-gguf:Q8_0", endpoint=url)
        assert pulled.returncode == 0, pulled.stderr
        assert pulled.stdout.strip().endswith("tiny-Q8_0.gguf")
        assert "image projector (mmproj-tiny-F16.gguf): not downloaded" in pulled.stderr
        by_name = tandem(tmp_path, "pull", "org/tiny-gguf/tiny-Q4_0.gguf", endpoint=url)
        assert by_name.stdout.strip().endswith("tiny-Q4_0.gguf"), by_name.stderr
        missing = tandem(tmp_path, "pull", "org/tiny-gguf:Q2_K", endpoint=url)
        untagged = tandem(tmp_path, "pull", "org/tiny-gguf", endpoint=url)
        unknown = tandem(tmp_path, "pull", "org/nothing", endpoint=url)
    assert missing.returncode == 2 and "no Q2_K file (it offers: Q4_0, Q8_0)" in missing.stderr
    assert untagged.returncode == 2 and "several GGUF files; pick one" in untagged.stderr
    assert unknown.returncode == 2 and "the hub refused it" in unknown.stderr
    ran = generate(tmp_path, "org/tiny-gguf:Q8_0", offline=True)
    assert ran.returncode == 0 and ran.stdout.strip(), ran.stderr
    listed = tandem(tmp_path, "models").stdout
    assert "org/tiny-gguf" in listed and "Q4_0, Q8_0" in listed


def test_a_split_gguf_is_pulled_whole_and_runs_as_one_file(tmp_path, hub_repos):
    from tandem.models.gguf_export import export_gguf

    repos, folder = hub_repos
    parts = sorted(p.name for p in repos["org/tiny-split"].iterdir())
    assert len(parts) > 2 and parts[0] == f"tiny-BF16-00001-of-{len(parts):05d}.gguf"
    with serving(FakeHub(repos)) as url:
        pulled = tandem(tmp_path, "pull", "org/tiny-split:BF16", endpoint=url)
    assert pulled.returncode == 0 and pulled.stdout.strip().endswith(parts[0]), pulled.stderr
    beside = sorted(p.name for p in Path(pulled.stdout.strip()).parent.iterdir())
    assert beside == parts  # every part downloaded, beside the first
    whole = export_gguf(folder, tmp_path / "whole-BF16.gguf", "bf16")
    by_id = generate(tmp_path, "org/tiny-split:BF16", offline=True)
    local = generate(tmp_path, str(whole), offline=True)
    assert by_id.returncode == 0 and by_id.stdout == local.stdout, by_id.stderr


def test_an_uncached_model_offline_is_refused_by_name(tmp_path):
    result = tandem(tmp_path, "pull", "org/elsewhere", offline=True)
    assert result.returncode == 2
    assert "org/elsewhere is not in the Hugging Face cache" in result.stderr
    assert "tandem pull org/elsewhere" in result.stderr and "Traceback" not in result.stderr
    unreachable = tandem(tmp_path, "pull", "org/elsewhere:Q4_K_M")  # no hub listening
    assert unreachable.returncode == 2 and "not in the Hugging Face cache" in unreachable.stderr
    # (asked once, without the listing's retries: an offline start does not wait ~25 s)
    assert "nothing answers at http://127.0.0.1:9" in unreachable.stderr


def test_the_cache_folder_is_named_as_huggingface_hub_names_it(tmp_path, monkeypatch):
    """Offline, tandem finds a snapshot without the client's HTTP imports: its folder
    name must stay the one huggingface_hub gives it."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    from tandem.models.hub import _cached

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    snapshot = tmp_path / repo_folder_name(repo_id="org/my-repo", repo_type="model")
    (snapshot / "refs").mkdir(parents=True)
    (snapshot / "refs" / "main").write_text("abc123")
    (snapshot / "snapshots" / "abc123").mkdir(parents=True)
    (snapshot / "snapshots" / "abc123" / "config.json").write_text("{}")
    assert _cached(parse_hub_id("org/my-repo"), None) == snapshot / "snapshots" / "abc123"
