"""A cluster of hosts on one machine for tests, benchmarks and tutorials: `tools/cluster.sh` (network namespaces joined
by a bridge in a switch namespace) driven from Python. Host `i` (1-based) has address 10.77.0.i and hostname `host{i}`,
which its /etc/hosts maps to 127.0.1.1 as Debian and Ubuntu do (and the other hosts' names to their addresses).

    with Cluster(2, rate='100mbit') as c:
        p = c.run(1, ['python', 'serve.py'])     # a subprocess.Popen running on host 1
        c.cut(2); c.restore(2)                   # unplug / plug back host 2's cable
"""
import os, shutil, subprocess, uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / 'tools' / 'cluster.sh'


def cluster_unavailable():
    "Why network namespaces cannot be made here, or None when they can"
    if os.environ.get('DTNB_NO_CLUSTER') == '1':  # `bash run.sh test` sets it: the hosts run in `run.sh test-long`
        return "DTNB_NO_CLUSTER=1: the namespace hosts run in `bash run.sh test-long`"
    if shutil.which('ip') is None: return "no `ip` command: install iproute2 (`bash run.sh test` does it as root)"
    if os.geteuid() != 0: return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which('tc') is None: return "no `tc` command: install iproute2"
    return None


class Cluster:
    "N namespace hosts, torn down on exit (and by `down()`): every process on them is killed, the namespaces deleted"
    def __init__(self, n:int, rate:str|None=None, prefix:str|None=None):
        self.n, self.rate = n, rate
        self.prefix = prefix or f"t{uuid.uuid4().hex[:7]}"
        self._up = False
        args = ['up', str(n), '--prefix', self.prefix] + (['--rate', rate] if rate else [])
        self._sh(*args)
        self._up = True

    def _sh(self, *args, check=True):
        r = subprocess.run(['bash', str(SCRIPT), *args], capture_output=True, text=True, timeout=60)
        if check and r.returncode: raise RuntimeError(f"cluster.sh {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    @property
    def hosts(self) -> list[int]: return list(range(1, self.n + 1))
    def addr(self, i:int) -> str: return f"10.77.0.{i}"
    def hostname(self, i:int) -> str: return f"host{i}"
    def netns(self, i:int) -> str: return f"{self.prefix}-h{i}"

    def argv(self, i:int, argv) -> list[str]:
        "The command line that runs `argv` on host `i`"
        return ['bash', str(SCRIPT), 'exec', '--prefix', self.prefix, str(i), '--', *map(str, argv)]

    def run(self, i:int, argv, env=None, **popen_kw) -> subprocess.Popen:
        "Start `argv` on host `i` (its pid is the command's own)"
        return subprocess.Popen(self.argv(i, argv), env=env, **popen_kw)

    def cut(self, i:int): self._sh('cut', '--prefix', self.prefix, str(i))
    def restore(self, i:int): self._sh('restore', '--prefix', self.prefix, str(i))
    def shape(self, i:int, rate:str|None):
        "Limit host `i`'s link both ways to `rate` (tc syntax: '1gbit', '100mbit'); None lifts the limit"
        self._sh('shape', '--prefix', self.prefix, str(i), rate or 'none')

    def pids(self, i:int|None=None) -> list[int]:
        "Pids of the processes running on host `i` (every host when None)"
        out = self._sh('pids', '--prefix', self.prefix, *([str(i)] if i else []))
        return [int(p) for p in out.split()]

    def down(self):
        if self._up: self._sh('down', '--prefix', self.prefix); self._up = False

    def __enter__(self): return self
    def __exit__(self, *exc): self.down()
    def __del__(self):
        try: self.down()
        except Exception: pass
