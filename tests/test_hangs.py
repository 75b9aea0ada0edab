"""A collective that outlives its timeout under `dtnb launch` (torchrun) names itself, its line and the ranks that
never came; and `fit` names a rank slower than the others with its cause. CPU ranks on gloo are the subject."""
import os, sys, subprocess, time, textwrap
from pathlib import Path
import pytest
from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]
DTNB = str(Path(sys.executable).with_name('dtnb'))
pytestmark = pytest.mark.usefixtures('cpu_ranks')

SKIP = textwrap.dedent('''
    import torch, torch.distributed as dist, dtnb
    dtnb.init_distributed(timeout=4)
    x = torch.ones(3)
    dist.all_reduce(x)
    if dist.get_rank() != 1:
        dist.all_reduce(x)  # rank 1 skips this one
    print('rank', dist.get_rank(), 'returned', flush=True)
''')

def test_skipped_all_reduce_under_dtnb_launch_names_rank_and_line(tmp_path):
    script = tmp_path / 'skip.py'; script.write_text(SKIP)
    t = time.monotonic()
    r = subprocess.run([DTNB, 'launch', '-n', '2', str(script)], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True, timeout=120)
    took, out = time.monotonic() - t, r.stdout + r.stderr
    assert r.returncode != 0, out
    assert took < 4 + 30, f"took {took:.0f} s"  # the 4 s timeout, start-up and torchrun's stop, not a hang
    summary = out.split('Root Cause (first observed failure)', 1)[-1]  # torchrun's first error holds our message
    for want in ('rank 0 waited', 'in all_reduce at skip.py:7 (`dist.all_reduce(x)`)', 'collective #2 of the default',
                 'rank 1 never issued it', 'after 1 collective of that group, it returned'):
        assert want in summary, f"{want!r} not in:\n{out[-3000:]}"
