"""Config: defaults work, and every bad key or value is an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from llamapool.config import ConfigError, from_dict, load_config

ROOT = Path(__file__).resolve().parent.parent


def test_default_config_loads_unedited() -> None:
    cfg = load_config(ROOT / "configs" / "default.toml")
    assert cfg.model.path == str(ROOT / "models" / "demo.gguf")
    assert cfg.workers.devices == "auto" and cfg.workers.slots == 8 and cfg.workers.cpu_workers == 2
    assert cfg.model.max_batch_tokens == 0 and cfg.model.n_ubatch == 1024
    assert cfg.frontend.startswith("ipc://") and cfg.frontend.endswith("frontend.sock")


def test_issue_example_keys_work() -> None:
    cfg = from_dict({
        "server": {"frontend": "ipc:///run/llamapool/frontend.sock"},
        "model": {"path": "/m.gguf"},
        "workers": {"devices": ["GPU-abc", 1], "cpu_workers": 3, "slots": 16, "env": {"X": 1}},
    })
    assert cfg.frontend == "ipc:///run/llamapool/frontend.sock"
    assert cfg.workers.devices == ["GPU-abc", 1] and cfg.workers.env == {"X": "1"}


@pytest.mark.parametrize("raw, key", [
    ({"model": {"path": "m", "bogus": 1}}, "model.bogus"),
    ({"model": {"path": "m"}, "workerz": {}}, "workerz"),
    ({"model": {}}, "model.path"),
    ({"model": {"path": "m"}, "workers": {"slots": 0}}, "workers.slots"),
    ({"model": {"path": "m"}, "workers": {"slots": "8"}}, "workers.slots"),
    ({"model": {"path": "m"}, "workers": {"devices": "gpu"}}, "workers.devices"),
    ({"model": {"path": "m"}, "workers": {"devices": [-1]}}, "workers.devices"),
    ({"model": {"path": "m"}, "workers": {"env": {"A": [1]}}}, "workers.env"),
    ({"model": {"path": "m", "max_batch_tokens": 8}, "workers": {"slots": 8}}, "model.max_batch_tokens"),
    ({"model": {"path": "m", "n_batch": 256}}, "model.n_batch: renamed to model.max_batch_tokens"),
    ({"model": {"path": "m", "prefill_chunk": 256}}, "model.prefill_chunk: replaced by model.max_batch_tokens"),
    ({"model": {"path": "m"}, "server": {"queue_timeout": -1}}, "server.queue_timeout"),
    ({"model": {"path": "m"}, "server": {"frontend": 5}}, "server.frontend"),
    ({"model": {"path": "m"}, "model2": 1}, "model2"),
])
def test_bad_config_names_the_key(raw: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        from_dict(raw)


def test_missing_file_and_bad_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[model\npath=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "bad.toml")


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / "c.toml").write_text('[model]\npath = "m.gguf"\n[workers]\nslots = -2\n')
    r = subprocess.run([sys.executable, "-m", "llamapool.cli", "serve", "--config", str(tmp_path / "c.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "workers.slots" in r.stderr


def test_http_table_is_optional_and_checked(tmp_path: Path) -> None:
    assert from_dict({"model": {"path": "m"}}).http is None
    cfg = load_config(ROOT / "configs" / "default.toml")
    assert cfg.http is not None and cfg.http.host_port == ("127.0.0.1", 8000) and cfg.http.processes == 1
    with pytest.raises(ConfigError, match=r"http\.listen"):
        from_dict({"model": {"path": "m"}, "http": {"listen": "8000"}})
    with pytest.raises(ConfigError, match=r"http\.api_keys_file"):
        from_dict({"model": {"path": "m"}, "http": {"api_keys_file": str(tmp_path / "none")}})
    (tmp_path / "empty").write_text("# no keys\n")
    with pytest.raises(ConfigError, match="holds no key"):
        from_dict({"model": {"path": "m"}, "http": {"api_keys_file": str(tmp_path / "empty")}})
