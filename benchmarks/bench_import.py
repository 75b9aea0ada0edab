"""Import cost of dtnb on top of torch, and `dtnb env` wall time. Prints figures; not a test.

Target (issue 2): `import dtnb` adds < 0.3 s to `import torch`; `dtnb env` < 3 s.
    python benchmarks/bench_import.py [--repeats 7]
"""
import argparse, statistics, subprocess, sys, time
from pathlib import Path

PROBE = """
import time; t0 = time.perf_counter()
import torch; t1 = time.perf_counter()
import dtnb; t2 = time.perf_counter()
{extra}
t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2)
"""

def probe(extra, repeats):
    rows = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, '-c', PROBE.format(extra=extra)], capture_output=True, text=True, check=True).stdout
        rows.append([float(x) for x in out.split()])
    return [statistics.median(c) for c in zip(*rows)]

def main():
    ap = argparse.ArgumentParser(); ap.add_argument('--repeats', type=int, default=7); a = ap.parse_args()
    import dtnb, pkgutil
    mods = sorted(m.name for m in pkgutil.iter_modules(dtnb.__path__) if not m.name.startswith('_') and m.name != 'cli')
    torch_s, dtnb_s, _ = probe('', a.repeats)
    *_, all_s = probe('\n'.join(f'import dtnb.{m}' for m in mods), a.repeats)
    exe = Path(sys.executable).parent / 'dtnb'
    env_s = []
    for _ in range(a.repeats):
        t = time.perf_counter(); subprocess.run([str(exe), 'env'], capture_output=True, check=True); env_s.append(time.perf_counter() - t)
    print(f"median of {a.repeats} fresh interpreters")
    print(f"  import torch                         {torch_s:7.3f} s")
    print(f"  import dtnb (after torch)            {dtnb_s:7.3f} s   target < 0.300  {'OK' if dtnb_s < 0.3 else 'MISSED'}")
    print(f"  import every dtnb module ({len(mods)}) after  {all_s:7.3f} s   ({', '.join(mods)})")
    print(f"  dtnb env, whole command              {statistics.median(env_s):7.3f} s   target < 3.000  {'OK' if statistics.median(env_s) < 3 else 'MISSED'}")
    print(f"  ratio (torch + dtnb) / torch         {(torch_s + dtnb_s) / torch_s:7.3f}")

if __name__ == '__main__':
    main()
