"""Start-up checks before the model loads (service/procs/preflight.py), one by one. The CLI's use of them
(exit status, one line, no model loaded) is in tests/unit/test_main.py."""

import fcntl
import os
import socket
import stat

import pytest

from service.errors import ModelLoadError, StartupError, StoreOwnershipError
from service.presets import check_model
from service.procs.preflight import bind, check_device, check_store, cuda_device_count, preflight
from service.store.directory import DirectoryStore


def test_model_is_a_preset_or_an_existing_directory(tmp_path):
    check_model("tiny")
    check_model("qwen3-vl-2b")
    check_model(str(tmp_path))  # what is inside is the loader's business
    with pytest.raises(ModelLoadError, match="neither a preset .*tiny.* nor an existing checkpoint directory"):
        check_model(str(tmp_path / "nope"))
    with pytest.raises(StartupError):  # the CLI catches one type for every check
        check_model("qwen3-vl-3b")


def test_an_explicit_cuda_device_needs_a_driver_that_sees_it():
    check_device("cpu")
    check_device("auto")  # auto needs nothing: it falls back to the CPU
    n = cuda_device_count()
    with pytest.raises(StartupError, match="cuda:99") as e:
        check_device("cuda:99")
    if n == 0:
        assert "no CUDA driver or GPU here; use --device cpu" in str(e.value)
        with pytest.raises(StartupError, match="use --device cpu"):
            check_device("cuda")
    else:
        assert f"sees {n} GPU(s)" in str(e.value)
        check_device("cuda:0")


def test_bind_refuses_a_port_with_a_listener_and_reuses_one_in_time_wait():
    with bind("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}: .*another process is listening"):
            bind("127.0.0.1", port)
        # A connection closed by the server side first leaves the server's port in TIME_WAIT ...
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = taken.accept()
        conn.close()
        client.recv(1)
        client.close()
    # ... which SO_REUSEADDR (uvicorn's setting too) lets a restarted server bind at once.
    with bind("127.0.0.1", port) as again:
        assert again.getsockname() == ("127.0.0.1", port)
        assert again.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR) == 1
        assert again.get_inheritable()  # the supervisor's API processes serve on it


def test_bind_reports_an_address_that_is_not_this_machines():
    with pytest.raises(StartupError, match="cannot listen on 192.0.2.1:") as e:
        bind("192.0.2.1", 0)  # TEST-NET-1: never a local address
    assert "another process" not in str(e.value)


def test_store_root_is_created_as_the_services_own_and_left_unlocked(tmp_path):
    root = tmp_path / "store"
    check_store(root, None)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    # The lock was released: the service's own store takes the root afterwards.
    store = DirectoryStore(root, 1 << 20, model_id="m", out_hidden_size=4, deepstack_levels=0, exclusive=True)
    try:
        with pytest.raises(StartupError, match=f"another service \\(pid {os.getpid()}\\) is writing to the store root"):
            check_store(root, None)
    finally:
        store.close()
    check_store(root, None)


def test_store_root_that_cannot_be_created_or_is_not_the_services_own(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match="cannot create the store root .*file/store.*choose another --store"):
        check_store(tmp_path / "file" / "store", None)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StartupError, match="writable by others \\(mode 0777\\).*chmod 700"):
        check_store(shared, None)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    fd = os.open(locked / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StartupError, match="another service .* one writer per root"):
            check_store(locked, None)
    finally:
        os.close(fd)


def test_store_checks_are_the_stores_own(tmp_path):
    """Same verdict and message as the service's store (one rule in one place, not a copy)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StoreOwnershipError) as by_store:
        DirectoryStore(shared, 1 << 20, model_id="m", out_hidden_size=4, deepstack_levels=0, exclusive=True)
    with pytest.raises(StartupError) as by_preflight:
        check_store(shared, None)
    assert str(by_preflight.value) == str(by_store.value)



def test_each_of_several_devices_needs_a_driver_that_sees_it():
    from service.config import Settings

    n = cuda_device_count()
    with pytest.raises(StartupError, match=f"^--devices cuda:{n}[: ]"):  # the first GPU beyond those there are
        preflight(Settings(devices=[f"cuda:{k}" for k in range(n + 2)], port=0))


def test_the_supervisor_api_processes_and_start_up_checks_run_without_importing_torch(tmp_path):
    """Importing torch (and transformers) takes seconds: the supervisor must not wait on it before it
    starts the engine process, which imports it anyway (bench/RESULTS.md: start-up 40.8 s with, against
    26.6 in one process), and the API processes (app, encode, decoders, ipc, the engine client) must not spend cores and memory
    on it while the engine starts. Every check, the whole of preflight included."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from service.config import Settings\n"
        "from service.procs.preflight import preflight\n"
        "import service.procs.supervisor, service.store.directory, service.store.format, service.api.app, service.api.encode\n"
        "import service.procs.ipc, service.procs.api_process, service.procs.decoders, service.engine.client\n"
        f"sock = preflight(Settings(model='tiny', device='cpu', port=0, store={str(tmp_path / 's')!r}))\n"
        "sock.close()\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'cupy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['numpy']", out.stdout  # numpy (the arena, decoding) is cheap; torch is not


def test_a_mooncake_master_not_up_yet_is_waited_for_and_one_that_never_comes_fails_in_a_line(tmp_path,
                                                                                             mooncake_master_binary):
    """An orchestrator starts the master beside the encoders, or restarts it: start-up waits for it (bounded,
    --mooncake-start-wait-s) instead of refusing, which would be a crash loop; a wrong address still fails."""
    import threading
    import time

    from service.procs.preflight import check_mooncake
    from tests.support.mooncake_pool import LOOPBACK, Master

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(StartupError, match=r"within 0.5 s \(--mooncake-start-wait-s\)"):
        check_mooncake(f"mooncake://127.0.0.1:{nobody}", wait_s=0.5)
    assert 0.4 < time.monotonic() - t0 < 3

    master = Master(mooncake_master_binary, LOOPBACK, tmp_path / "master.log")
    master.stop()  # its address, with nothing there for now
    later = threading.Timer(1.5, master.start)
    later.start()
    try:
        t0 = time.monotonic()
        check_mooncake(master.url, wait_s=30)
        took = time.monotonic() - t0
        print(f"start-up waited {took:.2f} s for a master started 1.5 s after it")
        assert 1.0 < took < 20, took
    finally:
        later.join()
        master.stop()
