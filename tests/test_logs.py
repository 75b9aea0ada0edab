"""dtnb's messages through `logging` (`dtnb.core.logs`), captured with caplog: per level, and per rank on two real gloo
ranks. The CPU is the subject: the ranks are CPU ranks (`cpu_ranks`, conftest.py)."""
import logging, os, socket, subprocess, sys, warnings
import pytest, torch
from dtnb.core.logs import get_logger, set_verbosity, DtnbWarning, UsageWarning
from dtnb.core.models import ToyModel, toy_data
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.train.loop import fit

pytestmark = pytest.mark.usefixtures('cpu_ranks')


def fit_to(ckpt, steps, strategy='single'):
    "fit up to `steps` with checkpoints in `ckpt`: a second call resumes, and says where from"
    torch.manual_seed(0)
    model = wrap(ToyModel(), strategy)
    loader = distributed_loader(toy_data(64), global_batch_size=16, shuffle=False)
    return fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), max_steps=steps, progress=False,
               checkpoint_dir=ckpt)


def fit_twice(ckpt, strategy='single'): fit_to(ckpt, 2, strategy); return fit_to(ckpt, 4, strategy)


def messages(caplog, name='dtnb'):
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name.startswith(name)]


def test_levels(caplog, tmp_path):
    caplog.set_level(logging.DEBUG)
    res = fit_twice(tmp_path / 'a')
    assert res.start_step == 2
    (level, msg), = [m for m in messages(caplog, 'dtnb.train.loop') if 'resumed' in m[1]]
    assert level == 'INFO' and msg.startswith(f"fit: resumed from {res.resumed_from} at step 2")
    caplog.clear()
    try:
        set_verbosity('WARNING')  # what `dtnb -q` does
        assert fit_to(tmp_path / 'a', 6).start_step == 4  # resumed, silently
        get_logger('dtnb.test').warning("a warning still shows")
        assert messages(caplog) == [('WARNING', "a warning still shows")]
        caplog.clear()
        set_verbosity('DEBUG')
        get_logger('dtnb.test').debug("debug shows")
        assert messages(caplog) == [('DEBUG', "debug shows")]
    finally: set_verbosity('INFO')


def test_rank_of_a_launcher_variable(caplog, monkeypatch):
    "Without a process group the record's rank is the launcher's RANK: only rank 0 logs INFO, every rank warns"
    caplog.set_level(logging.INFO)
    log = get_logger('dtnb.test')
    monkeypatch.setenv('WORLD_SIZE', '2')
    for r in ('0', '1'):
        monkeypatch.setenv('RANK', r); log.info(f"info from {r}"); log.warning(f"warning from {r}")
    assert [(x.rank, x.levelname) for x in caplog.records] == [(0, 'INFO'), (0, 'WARNING'), (1, 'WARNING')]


def _on_ranks(ckpt):
    "On each rank: fit twice under DDP, with a handler of our own; the records this rank kept"
    class Keep(logging.Handler):
        def __init__(self): super().__init__(); self.kept = []
        def emit(self, r): self.kept.append((r.rank, r.levelname, r.getMessage()))
    keep = Keep(); logging.getLogger().addHandler(keep)
    res = fit_twice(ckpt, 'ddp')
    get_logger('dtnb.test').warning("each rank warns")
    set_verbosity(all_ranks=True); get_logger('dtnb.test').info("every rank speaks"); set_verbosity(all_ranks=False)
    return [k for k in keep.kept if 'resumed' in k[2] or k[2] in ("each rank warns", "every rank speaks")], \
        res.resumed_from


def test_ranks_of_a_process_group(tmp_path):
    "On 2 real gloo ranks: the resume message from rank 0 only, warnings and all_ranks from both, each stamped"
    out = launch(_on_ranks, str(tmp_path), nprocs=2)
    (r0, path0), (r1, path1) = out
    assert path0 == path1 and path0
    assert r0 == [(0, 'INFO', f"fit: resumed from {path0} at step 2"), (0, 'WARNING', "each rank warns"),
                  (0, 'INFO', "every rank speaks")]
    assert r1 == [(1, 'WARNING', "each rank warns"), (1, 'INFO', "every rank speaks")]


def test_warnings_are_dtnb_warnings():
    "A warning dtnb gives is a DtnbWarning of its kind: a per-epoch schedule stepped per step"
    torch.manual_seed(0)
    model = ToyModel(); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.001)
    loader = torch.utils.data.DataLoader(toy_data(32), batch_size=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fit(model, loader, opt, epochs=1, scheduler=sched, progress=False)
    cats = [x.category for x in w if issubclass(x.category, DtnbWarning)]
    assert cats == [UsageWarning], [(x.category, str(x.message)) for x in w]


def test_progress_lines_go_through_the_loop_logger(caplog, monkeypatch):
    "Under a launcher fit's progress is a line every few seconds: an INFO record of dtnb.train.loop, not a print"
    monkeypatch.setenv('DTNB_LAUNCH', '1'); monkeypatch.setenv('RANK', '0'); monkeypatch.setenv('WORLD_SIZE', '1')
    caplog.set_level(logging.INFO)
    torch.manual_seed(0)
    model = ToyModel()
    loader = torch.utils.data.DataLoader(toy_data(32), batch_size=8)
    fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), max_steps=3)
    lines = [m for level, m in messages(caplog, 'dtnb.train.loop') if level == 'INFO' and ' · loss ' in m]
    assert len(lines) == 2 and lines[0].startswith('fit: step 1/3 · loss ') and lines[1].startswith('fit: step 3/3')


LOST = '''
import io, logging, sys
from dtnb.launcher.network import PeerLostError, _exit_lost
logging.basicConfig(filename=sys.argv[1], format='%(name)s: %(message)s')  # a handler of your own gets it too
sys.stderr = io.StringIO()  # as torch's excepthook holds sys.stderr: the line must reach the real one
_exit_lost(PeerLostError("lost rank 1 on h2 (10.0.0.2): not heard from for 60 s", 1, 'h2'))
'''


def test_a_rank_that_stops_for_a_lost_peer_says_so_on_the_real_stderr(tmp_path):
    "The last line of a rank that ends itself (os._exit) for a lost peer: on the process's stderr and in your handlers"
    log = tmp_path / 'rank0.log'
    env = {**os.environ, 'RANK': '0', 'WORLD_SIZE': '2'}
    r = subprocess.run([sys.executable, '-c', LOST, str(log)], env=env, capture_output=True, text=True, timeout=60)
    want = f"rank 0 on {socket.gethostname()} stops: lost rank 1 on h2 (10.0.0.2): not heard from for 60 s"
    assert r.returncode == 1 and f"[rank 0] ERROR: dtnb.launcher.network: {want}" in r.stderr, r.stderr
    assert f"dtnb.launcher.network: {want}" in log.read_text()
