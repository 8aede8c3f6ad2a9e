"""deploy/: the systemd unit and its companions, the config file, Prometheus (a real
server scraping a daemon that serves a training client) and the Grafana dashboard."""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import fuyou_client
from conftest import SMALL, merge
from fuyoud import config as config_mod

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
TOOLS = ROOT / ".fuyou" / "tools" / "bin"


def tool(name: str) -> str | None:
    return shutil.which(name) or (str(TOOLS / name) if (TOOLS / name).exists() else None)


# -- systemd ---------------------------------------------------------------------------
needs_systemd = pytest.mark.skipif(tool("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (./run.sh test installs Debian's systemd)")


def install_service(root: Path) -> subprocess.CompletedProcess:
    fuyoud = Path(sys.executable).parent / "fuyoud"
    return subprocess.run([sys.executable, "-m", "fuyoud", "install-service", "--root", str(root),
                           "--executable", str(fuyoud)], capture_output=True, text=True, timeout=60)


@needs_systemd
def test_install_service_writes_a_unit_that_systemd_analyze_verifies(tmp_path):
    done = install_service(tmp_path)
    assert done.returncode == 0, done.stderr
    unit = tmp_path / "etc/systemd/system/fuyoud.service"
    text = unit.read_text()
    assert f"ExecStart={Path(sys.executable).parent / 'fuyoud'} --config /etc/fuyoud/fuyoud.toml" in text
    # The data directories of the installed config must be writable under ProtectSystem=strict.
    cfg = config_mod.load(tmp_path / "etc/fuyoud/fuyoud.toml")
    writable = re.search(r"^ReadWritePaths=(.*)$", text, re.M).group(1).split()
    assert {str(p) for p in [cfg.daemon.state_dir, *cfg.data_dirs]} <= set(writable)
    for line in ("Type=notify", "WatchdogSec=", "RuntimeDirectory=fuyoud", "User=fuyoud", "Group=fuyoud",
                 "LimitMEMLOCK=infinity", "Restart=on-failure", "ProtectSystem=strict", "NoNewPrivileges=yes",
                 "SystemCallFilter=@system-service"):
        assert line in text, line
    verify = subprocess.run([tool("systemd-analyze"), "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stderr
    assert "fuyoud.service" not in verify.stderr, verify.stderr  # no warnings about our unit either
    # io_uring survives the syscall filter: @system-service holds @aio, which holds io_uring_*
    groups = subprocess.run([tool("systemd-analyze"), "syscall-filter", "@aio"], capture_output=True, text=True).stdout
    assert "io_uring_enter" in groups and "io_uring_setup" in groups
    # A second run keeps an edited config.
    cfg_file = tmp_path / "etc/fuyoud/fuyoud.toml"
    cfg_file.write_text(cfg_file.read_text().replace('log_level = "info"', 'log_level = "debug"'))
    assert install_service(tmp_path).returncode == 0
    assert 'log_level = "debug"' in cfg_file.read_text()


def test_the_unit_may_write_every_directory_of_the_config(tmp_path):
    """Under ProtectSystem=strict the daemon writes only where ReadWritePaths= says: its
    config's data and checkpoint directories must be there, and exist at start."""
    cfg_file = tmp_path / "etc/fuyoud/fuyoud.toml"
    cfg_file.parent.mkdir(parents=True)
    cfg_file.write_text('[daemon]\nstate_dir = "/var/lib/fuyoud"\ncheckpoint_dirs = ["/data/ckpt-a", "/srv/ckpt-b"]\n'
                        '[storage]\ndata_dirs = ["/mnt/nvme0/fuyou", "/mnt/nvme1/fuyou"]\n')
    done = install_service(tmp_path)
    assert done.returncode == 0, done.stderr
    unit = (tmp_path / "etc/systemd/system/fuyoud.service").read_text()
    writable = re.search(r"^ReadWritePaths=(.*)$", unit, re.M).group(1).split()
    wanted = ["/var/lib/fuyoud", "/mnt/nvme0/fuyou", "/mnt/nvme1/fuyou", "/data/ckpt-a", "/srv/ckpt-b"]
    assert sorted(writable) == sorted(wanted)
    mounts = re.search(r"^RequiresMountsFor=(.*)$", unit, re.M).group(1).split()
    assert sorted(mounts) == sorted(wanted)  # an SSD not mounted stops the start
    tmpfiles = (tmp_path / "etc/tmpfiles.d/fuyoud.conf").read_text()
    made = {line.split()[1] for line in tmpfiles.splitlines() if line.startswith("d ")}
    assert set(wanted) <= made
    assert tmpfiles.count("d /var/lib/fuyoud ") == 1  # the shipped entries are not repeated


@needs_systemd
def test_sysusers_and_tmpfiles_entries_apply(tmp_path):
    if tool("systemd-sysusers") is None or tool("systemd-tmpfiles") is None:
        pytest.skip("systemd-sysusers/systemd-tmpfiles not installed")
    (tmp_path / "etc").mkdir()
    for name in ("passwd", "group", "shadow", "gshadow"):
        (tmp_path / "etc" / name).write_text("root:x:0:0:root:/root:/bin/sh\n" if name == "passwd" else
                                             "root:x:0:\n" if name == "group" else "")
    users = subprocess.run([tool("systemd-sysusers"), f"--root={tmp_path}", str(DEPLOY / "sysusers.d/fuyoud.conf")],
                           capture_output=True, text=True, timeout=60)
    assert users.returncode == 0, users.stderr
    passwd = (tmp_path / "etc/passwd").read_text()
    entry = next(line for line in passwd.splitlines() if line.startswith("fuyoud:"))
    uid, gid, home = entry.split(":")[2], entry.split(":")[3], entry.split(":")[5]
    assert home == "/var/lib/fuyoud"
    assert f"fuyoud:x:{gid}:" in (tmp_path / "etc/group").read_text()
    dirs = subprocess.run([tool("systemd-tmpfiles"), f"--root={tmp_path}", "--create",
                           str(DEPLOY / "tmpfiles.d/fuyoud.conf")], capture_output=True, text=True, timeout=60)
    assert dirs.returncode == 0, dirs.stderr
    st = (tmp_path / "var/lib/fuyoud/data").stat()
    assert st.st_mode & 0o777 == 0o750 and (st.st_uid, st.st_gid) == (int(uid), int(gid))


# -- the config file -------------------------------------------------------------------------
def test_deploy_config_lists_every_option():
    data = tomllib.loads((DEPLOY / "fuyoud.toml").read_text())
    for section in dataclasses.fields(config_mod.Config):
        keys = {f.name for f in dataclasses.fields(section.type if isinstance(section.type, type)
                                                   else getattr(config_mod, section.type))}
        assert set(data.get(section.name, {})) == keys, section.name
    config_mod.from_dict(data)


# -- metrics: a daemon that served a training client ------------------------------------------
@pytest.fixture(scope="module")
def trained_daemon(tmp_path_factory):
    """A daemon after a short training run, a checkpoint and an error, its client still
    attached (so per-session series exist)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="fy-dep-", dir="/tmp"))
    d = fuyou_client.start_daemon(root / "state", config=merge(SMALL, {"storage": {"data_dirs": [str(root / "ssd0"),
                                                                                                str(root / "ssd1")]}}))
    from test_ops import Blocks, train

    model = Blocks()
    engine = fuyou_client.attach(model, socket=d.socket)
    train(engine, model, 4)
    engine.session.checkpoint(root / "ckpt", mode="copy")
    with pytest.raises(fuyou_client.ObjectNotFound):
        engine.session.stat("no-such-object")
    time.sleep(0.3)
    try:
        yield d, engine, model
    finally:
        engine.close()
        assert d.stop() == 0, d.log()
        shutil.rmtree(root, ignore_errors=True)


def families(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "info": ["_info"]}


def exported_names(fams: dict) -> set[str]:
    """Series names the daemon exports (a labelled family with no child yet counts)."""
    names = set()
    for f in fams.values():
        names.add(f.name)
        names.update(f.name + suffix for suffix in SUFFIXES.get(f.type, []))
        names.update(s.name for s in f.samples)
    return names


# What an operator needs (the operations issue's list), by exported series name.
OPERATOR_METRICS = [
    "fuyoud_io_bytes_total", "fuyoud_io_batch_duration_seconds_bucket", "fuyoud_io_queue_depth",
    "fuyoud_pinned_bytes", "fuyoud_session_pinned_bytes", "fuyoud_objects", "fuyoud_optimizer_group_steps_total",
    "fuyoud_optimizer_step_seconds_bucket", "fuyoud_client_exposed_optimizer_seconds_total",
    "fuyoud_client_iteration_seconds_total", "fuyoud_activation_bytes_total", "fuyoud_checkpoint_duration_seconds_bucket",
    "fuyoud_errors_total", "fuyoud_device_lifetime_bytes_total", "fuyoud_build_info", "fuyoud_sessions",
    "fuyoud_session_info", "fuyoud_session_optimizer_buffers",
]


def test_metrics_cover_what_operators_need_with_help_text(trained_daemon):
    d, engine, _ = trained_daemon
    fams = families(d.status().metrics_url)
    names = exported_names(fams)
    missing = [m for m in OPERATOR_METRICS if m not in names]
    assert not missing, missing
    for f in fams.values():
        assert f.documentation and len(f.documentation) > 10, f.name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in fams.values() for s in f.samples}
    sid = str(engine.session.status().session_list[0].id)
    assert samples[("fuyoud_session_pinned_bytes", (("session", sid),))] > 0
    namespace = engine.session.namespace  # (no job: not <job>.r<rank>)
    assert samples[("fuyoud_session_info", (("namespace", namespace), ("rank", ""), ("session", sid),
                                            ("training_job", "")))] == 1
    assert samples[("fuyoud_errors_total", (("kind", "not_found"),))] == 1
    written = sum(v for (n, labels), v in samples.items()
                  if n == "fuyoud_device_lifetime_bytes_total" and ("direction", "write") in labels)
    assert written >= samples[("fuyoud_checkpoint_bytes_total", (("mode", "copy"),))] > 0
    assert {s.labels["device"] for s in fams["fuyoud_io_queue_depth"].samples} == {"0", "1"}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana/dashboards/fuyoud.json").read_text())


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]


def test_grafana_dashboard_uses_only_exported_metrics(trained_daemon):
    d, _, _ = trained_daemon
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["panels"]
    names = exported_names(families(d.status().metrics_url))
    used = {m for q in dashboard_queries() for m in re.findall(r"\bfuyoud_[a-z0-9_]+", q)}
    assert used and not used - names, sorted(used - names)
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("throughput", "latency", "pinned memory by state", "sessions", "optimizer", "overlap",
                  "activation", "errors"):
        assert topic in titles, topic
    for path in (DEPLOY / "grafana/provisioning").rglob("*.yml"):
        assert "apiVersion: 1" in path.read_text(), path


# -- Prometheus, for real ------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


@pytest.mark.slow  # (a real Prometheus started and waited for: about 10 s)
def test_prometheus_scrapes_a_daemon_serving_a_training_client(trained_daemon, tmp_path):
    prometheus = tool("prometheus")
    if prometheus is None:
        pytest.skip("no prometheus binary: ./run.sh test fetches Debian's package (apt-get download prometheus)")
    d, engine, model = trained_daemon
    target = urllib.parse.urlparse(d.status().metrics_url).netloc
    config = (DEPLOY / "prometheus.yml").read_text().replace("127.0.0.1:9464", target)
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("evaluation_interval: 15s",
                                                                                 "evaluation_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(DEPLOY / "fuyoud-alerts.yml", tmp_path / "fuyoud-alerts.yml")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))
    try:
        from test_ops import train

        deadline = time.monotonic() + 60
        while True:  # train on while Prometheus starts and scrapes
            train(engine, model, 2, seed=int(time.monotonic()))
            try:
                up = query(base, 'up{job="fuyoud"}')
                steps = query(base, "fuyoud_optimizer_group_steps_total")
                if up and up[0]["value"][1] == "1" and steps and float(steps[0]["value"][1]) > 20:
                    break
            except (OSError, AssertionError):
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        train(engine, model, 3)
        time.sleep(2.5)  # two more scrapes

        def value(expr):
            result = query(base, expr)
            assert result, f"no data for {expr}"
            return float(result[0]["value"][1])

        assert value('sum(fuyoud_io_bytes_total{direction="write"})') > 1e5
        assert value('sum(fuyoud_io_bytes_total{direction="read"})') > 1e5
        assert value("sum(rate(fuyoud_io_bytes_total[30s]))") > 0
        assert value('fuyoud_pinned_bytes{state="allocated"}') > 0
        assert value("fuyoud_pinned_budget_bytes") == 256 << 20
        assert value("fuyoud_sessions") == 1
        # Per-session series join with the session's namespace (and job, rank) on `session`:
        assert value("sum(fuyoud_session_pinned_bytes * on (instance, session) group_left (namespace) "
                     "fuyoud_session_info)") > 0
        assert value("fuyoud_optimizer_group_steps_total") >= 25
        assert 0 < value("histogram_quantile(0.5, sum by (le) (rate(fuyoud_optimizer_step_seconds_bucket[30s])))") < 10
        assert value("fuyoud_client_iterations_total") >= 5
        overlap = value("1 - fuyoud_client_exposed_optimizer_seconds_total / fuyoud_client_iteration_seconds_total")
        assert 0 <= overlap < 1
        # Every dashboard query is valid PromQL and, but for rates over idle series, has data.
        for expr in dashboard_queries():
            q = expr.replace("$__rate_interval", "30s").replace('instance=~"$instance"', 'instance=~".*"')
            query(base, q)
        rules = json.loads(urllib.request.urlopen(f"{base}/api/v1/rules", timeout=10).read())["data"]["groups"]
        assert {r["name"] for g in rules for r in g["rules"]} >= {"FuyoudDown", "FuyoudSSDErrors"}
        assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
    finally:
        proc.terminate()
        proc.wait(30)
