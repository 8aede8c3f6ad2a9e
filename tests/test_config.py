import subprocess
import sys
from pathlib import Path

import pytest

from fuyoud.config import ConfigError, from_dict, load


def test_defaults_work_without_a_file():
    cfg = load(None)
    assert cfg.data_dirs == [cfg.daemon.state_dir / "data"]
    assert cfg.daemon.control_path.name == "fuyoud.sock"
    assert cfg.memory.pinned_budget > 0 and cfg.session_budget == cfg.memory.pinned_budget
    assert cfg.metrics.listen.startswith("127.0.0.1:")


def test_the_defaults_serve_a_training_server():
    """Half of memory may be pinned (a ceiling: a client plans what it needs), and the data
    files grow on demand ("auto", 0) while they leave keep_free ("auto", 0) on the disk."""
    import os

    cfg = load(None)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert total // 2 - 4096 < cfg.memory.pinned_budget <= total // 2
    assert cfg.storage.capacity_per_device == 0 and cfg.storage.keep_free == 0
    explicit = from_dict({"storage": {"capacity_per_device": "auto", "keep_free": "10GiB"}})
    assert (explicit.storage.capacity_per_device, explicit.storage.keep_free) == (0, 10 << 30)
    with pytest.raises(ConfigError, match=r"\[memory.pinned_budget\]: not a size"):
        from_dict({"memory": {"pinned_budget": "auto"}})  # ("auto" only where it means something)


def test_sizes_parse_in_human_units():
    cfg = from_dict({"memory": {"pinned_budget": "1GiB", "segment_size": "64MiB"}, "io": {"chunk_size": 4096}})
    assert cfg.memory.pinned_budget == 1 << 30
    assert cfg.memory.segment_size == 64 << 20
    assert cfg.io.chunk_size == 4096


@pytest.mark.parametrize("data, words", [
    ({"memory": {"pinned_bugdet": 1}}, "unknown key [memory.pinned_bugdet]"),
    ({"nonsense": {}}, "unknown section [nonsense]"),
    ({"io": {"engine": "spdk"}}, "[io.engine]"),
    ({"io": {"queue_depth": 0}}, "[io.queue_depth]: must be positive"),
    ({"io": {"queue_depth": "32"}}, "[io.queue_depth]: expected int"),
    ({"io": {"chunk_size": 1000}}, "multiple of 4096"),
    ({"memory": {"pinned_budget": "lots"}}, "[memory.pinned_budget]: not a size"),
    ({"memory": {"pinned_budget": "1GiB", "session_budget": "2GiB"}}, "session_budget"),
    ({"storage": {"data_dirs": ["/a", "/a"]}}, "twice"),
    ({"storage": {"data_dirs": "/a"}}, "expected list"),
])
def test_bad_values_are_refused_by_name(data, words):
    with pytest.raises(ConfigError) as err:
        from_dict(data)
    assert words in str(err.value)


def test_check_config_command(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[memory]\npinned_budget = "512MiB"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text('[storage]\ncapacity = "1GiB"\n')
    ok = subprocess.run([sys.executable, "-m", "fuyoud", "--config", str(good), "--check-config"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run([sys.executable, "-m", "fuyoud", "--config", str(bad), "--check-config"],
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert "unknown key [storage.capacity]" in refused.stderr


DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
# Where the sample says its values differ from the defaults (its header: "the paths,
# pinned_budget, data_dirs, capacity_per_device"): a systemd install's.
SYSTEMD_VALUES = {
    "daemon.state_dir": Path("/var/lib/fuyoud"), "daemon.runtime_dir": Path("/run/fuyoud"),
    "daemon.checkpoint_dirs": [Path("/var/lib/fuyoud/checkpoints")], "memory.pinned_budget": 8 << 30,
    "storage.data_dirs": [Path("/var/lib/fuyoud/data")], "storage.capacity_per_device": 16 << 30,
}


def test_the_sample_config_sets_every_option_to_its_default_but_a_systemd_installs():
    """deploy/fuyoud.toml promises every option, each at its default except a systemd
    install's paths and sizes: an option added without it, a default changed on one side
    only, or a value the loader drops or misreads fails here."""
    import dataclasses
    import tomllib

    from fuyoud.config import Config

    sample = tomllib.loads((DEPLOY / "fuyoud.toml").read_text())
    cfg, defaults = load(DEPLOY / "fuyoud.toml"), Config()
    options = {f"{s.name}.{f.name}" for s in dataclasses.fields(Config) for f in dataclasses.fields(getattr(cfg, s.name))}
    written = {f"{section}.{key}" for section, values in sample.items() for key in values}
    assert written == options, f"missing from the sample: {sorted(options - written)}; unknown: {sorted(written - options)}"
    for key in sorted(options):
        section, name = key.split(".")
        got, default = getattr(getattr(cfg, section), name), getattr(getattr(defaults, section), name)
        if key in SYSTEMD_VALUES:
            assert got == SYSTEMD_VALUES[key] != default, key
        else:
            assert got == default, f"[{key}]: the sample says {got!r}, the default is {default!r}"
    assert cfg.checkpoint_dirs == [cfg.daemon.state_dir / "checkpoints"]  # (the default's place under that state_dir)
    # The paths are those the unit gives the daemon (StateDirectory=, RuntimeDirectory=).
    unit = (DEPLOY / "fuyoud.service").read_text()
    assert "StateDirectory=fuyoud" in unit and "RuntimeDirectory=fuyoud" in unit
