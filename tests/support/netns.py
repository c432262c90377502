"""Simulated hosts for the multi-host tests: one Linux network namespace per host, each joined by a veth
pair to a bridge on a private /24 that the test process (in the root namespace) reaches through the
bridge's own address; or, where namespaces cannot be made (not root, no iproute2, no CAP_NET_ADMIN),
every host on loopback, told apart by its ports.

    root namespace                                 namespace qve<pid>-<name> (one per host)
    bridge qve<pid>br  10.222.X.1/24  ── veth qve<pid>v<i> ──   eth0 10.222.X.(10+i)/24, lo

X is the first /24 of 10.222.0.0/16 that no address or route of this machine overlaps. `Hosts(names)` is
a context manager; `hosts[name]` is a `Host`: its `address`, the `prefix` that runs a command on it, its
listening sockets. Everything it made is removed when it exits, on every path: an exception, Ctrl-C, and
SIGTERM (turned into KeyboardInterrupt meanwhile, so pytest's teardown runs); what a run killed by SIGKILL
left behind is removed by the next run (every name carries its creator's pid, and a dead creator's are
swept). QVE_TEST_HOSTS=loopback forces loopback; QVE_TEST_HOSTS=netns makes a namespace that cannot be
built an error instead of a fallback.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_NAME = re.compile(r"^qve(\d+)(?:-.+|br|v\d+)$")  # ours: namespaces qve<pid>-<host>, links qve<pid>br, qve<pid>v<i>
SUPERNET = ipaddress.ip_network("10.222.0.0/16")


@dataclass(frozen=True)
class Listener:
    address: str  # as ss prints it: 10.222.7.11, 0.0.0.0, [::], *, 127.0.0.1
    port: int
    processes: tuple[str, ...]  # process names ss names (needs root for other users' sockets)


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # where the other hosts and the test process reach it
    netns: str | None  # its namespace; None on loopback

    @property
    def prefix(self) -> list[str]:
        """What runs a command on this host: `ip netns exec NS` (which execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns] if self.netns else []

    def listening(self) -> list[Listener]:
        """The TCP sockets listening on this host (in its namespace; on loopback, the whole machine's)."""
        if self.netns is None and shutil.which("ss") is None:
            return proc_listeners()  # (a machine without iproute2: a GPU machine's image)
        out = _run([*self.prefix, "ss", "-tlnpH"]).stdout
        found = []
        for line in out.splitlines():
            cols = line.split()
            local = cols[3]
            addr, _, port = local.rpartition(":")
            found.append(Listener(addr.split("%")[0], int(port), tuple(re.findall(r'\("([^"]+)"', line))))
        return found


def proc_listeners() -> list[Listener]:
    """What `ss -tlnp` tells, read from /proc: each LISTEN socket of /proc/net/tcp{,6}, named by the
    processes holding it (their comm; those of other users need root, as with ss)."""
    holders: dict[str, list[str]] = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            comm = (fd_dir.parent / "comm").read_text().strip()
            for fd in fd_dir.iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    holders.setdefault(target[8:-1], []).append(comm)
        except OSError:  # (gone meanwhile, or not ours to read)
            continue
    found = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A":  # LISTEN
                continue
            hex_addr, hex_port = cols[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # (the kernel prints each 32-bit word in host order: little-endian here)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            addr = str(ipaddress.ip_address(raw))
            found.append(Listener(f"[{addr}]" if v6 else addr, int(hex_port, 16), tuple(holders.get(cols[9], ()))))
    return found


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_pids(ns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()]


def _kill_and_wait(pids: list[int], timeout: float = 10.0) -> None:
    """SIGKILL processes left in a namespace being removed (ours: only our tests start processes there)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of runs whose creator is gone (a SIGKILLed pytest); what was removed."""
    removed = []
    if shutil.which("ip") is None:
        return removed
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if (m := _NAME.match(name)) and not _pid_alive(int(m[1])):
            _kill_and_wait(_netns_pids(name))
            if _run(["ip", "netns", "del", name], check=False).returncode == 0:
                removed.append(name)
    for name in _links():
        if (m := _NAME.match(name)) and not _pid_alive(int(m[1])):
            if _run(["ip", "link", "del", name], check=False).returncode == 0:
                removed.append(name)
    return removed


def _free_subnet(start: int) -> ipaddress.IPv4Network:
    """The first 10.222.X.0/24 from X = start on that overlaps no address or route of the root namespace
    (the default route aside: it overlaps everything)."""
    taken = []
    for entry in json.loads(_run(["ip", "-j", "-4", "addr", "show"]).stdout):
        for a in entry.get("addr_info", []):
            taken.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    for route in json.loads(_run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout):
        dst = route.get("dst", "default")
        if dst != "default":
            taken.append(ipaddress.ip_network(dst, strict=False))
    for i in range(254):
        x = (start + i) % 254 + 1
        net = ipaddress.ip_network(f"10.222.{x}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("every 10.222.X.0/24 overlaps an address or route of this machine")


def _refused(host: str, port: int = 9, timeout: float = 2.0) -> bool:
    """A TCP connect to a closed port is refused (an RST came back: the host is reachable)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return True


@dataclass
class Hosts:
    """One simulated host per name, in network namespaces where they can be made, else on loopback.
    `mode` says which ("netns" or "loopback"), `why` why not namespaces."""

    names: list[str]
    hosts: dict[str, Host] = field(default_factory=dict)
    mode: str = ""
    why: str = ""
    subnet: ipaddress.IPv4Network | None = None
    bridge: str | None = None
    _made_ns: list[str] = field(default_factory=list)
    _made_links: list[str] = field(default_factory=list)
    _old_sigterm: object = None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __enter__(self) -> Hosts:
        forced = os.environ.get("QVE_TEST_HOSTS", "")
        why = "QVE_TEST_HOSTS=loopback" if forced == "loopback" else self._cannot()
        if not why:
            try:
                self._build()
            except Exception as e:  # a restricted container, a filtered bridge: loopback then, saying why
                why = f"building the namespaces failed: {e}"
                self._teardown()
        if why:
            if forced == "netns":
                raise RuntimeError(f"QVE_TEST_HOSTS=netns, but network namespaces cannot be made here: {why}")
            self.mode, self.why = "loopback", why
            self.hosts = {n: Host(n, "127.0.0.1", None) for n in self.names}
        else:
            self.mode = "netns"
        if threading.current_thread() is threading.main_thread():
            # SIGTERM would end pytest without its teardown, leaving namespaces, links and servers behind.
            self._old_sigterm = signal.signal(signal.SIGTERM, _interrupt)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
        # After a clean run every process should have ended with its server: one still in a namespace
        # after a grace period is a leak, named (and killed) here. On an error or an interrupt, just kill.
        stragglers = self.stragglers(grace_s=10.0) if exc_type is None else []
        left = self._teardown()
        assert not left, f"could not remove {left}"
        assert not stragglers, f"processes outlived their servers: {stragglers}"

    def stragglers(self, grace_s: float) -> list[str]:
        """The processes still in our namespaces once `grace_s` has passed (pid and command line)."""
        deadline = time.monotonic() + grace_s
        while (pids := [p for ns in self._made_ns for p in _netns_pids(ns) if not _zombie(p)]) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        found = []
        for pid in pids:
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{pid}: {cmd[:160]}")
        return found

    @staticmethod
    def _cannot() -> str:
        if not sys.platform.startswith("linux"):
            return f"not Linux ({sys.platform})"
        if os.geteuid() != 0:
            return "not root (network namespaces and veth pairs need CAP_NET_ADMIN)"
        if shutil.which("ip") is None or shutil.which("ss") is None:
            return "iproute2 (ip, ss) is not installed"
        return ""

    def _build(self) -> None:
        sweep_stale()
        pid = os.getpid()
        self.subnet = _free_subnet(pid % 254)
        net = list(self.subnet.hosts())  # .1 is the bridge's (the test process's address on the subnet)
        self.bridge = f"qve{pid}br"
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made_links.append(self.bridge)
        _run(["ip", "addr", "add", f"{net[0]}/{self.subnet.prefixlen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])
        for i, name in enumerate(self.names):
            ns, veth, address = f"qve{pid}-{name}", f"qve{pid}v{i}", str(net[9 + i])
            _run(["ip", "netns", "add", ns])
            self._made_ns.append(ns)
            # The namespace's end is made inside it as eth0: no name to clash with in the root namespace.
            _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._made_links.append(veth)
            _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            self.hosts[name] = Host(name, address, ns)
        # Reachable from here, and from one namespace to another (a bridge netfilter can filter): refused
        # connections prove the packets got there and back. Fresh links may take a moment to forward.
        first, *others = self.hosts.values()
        deadline = time.monotonic() + 10
        while not all(_refused(h.address) for h in self.hosts.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the namespaces on {self.bridge} do not answer from the root namespace")
            time.sleep(0.1)
        if others:
            probe = (f"import socket\ntry: socket.create_connection(({others[0].address!r}, 9), timeout=2)\n"
                     "except ConnectionRefusedError: pass")
            done = _run([*first.prefix, sys.executable, "-c", probe], check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{first.name} does not reach {others[0].name} over {self.bridge}: "
                                   f"{done.stderr.strip()[-200:]}")

    def _teardown(self) -> list[str]:
        """Remove what was made (processes left in a namespace first: they would keep it alive); what
        could not be removed."""
        left = []
        for ns in reversed(self._made_ns):
            _kill_and_wait(_netns_pids(ns))
            if _run(["ip", "netns", "del", ns], check=False).returncode != 0:
                left.append(ns)
        for link in reversed(self._made_links):  # (a veth goes with its namespace, a moment later)
            _run(["ip", "link", "del", link], check=False)
        deadline = time.monotonic() + 5
        while (still := [n for n in self._made_links if n in _links()]) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._made_ns, self._made_links = [], []
        return left + still


def _links() -> set[str]:
    return {link.get("ifname") for link in json.loads(_run(["ip", "-j", "link", "show"], check=False).stdout or "[]")}


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
