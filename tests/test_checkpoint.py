"""Checkpoints under torchrun restarts, with pipeline stages, and with loaders that have workers.

The fault test kills a rank with SIGKILL under `dtnb launch --max-restarts=1` and checks that the finished run is
bitwise the uninterrupted one. Every test checks real files written by real processes; nothing is mocked.
The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import json, os, subprocess, sys
from pathlib import Path
import pytest, torch
from conftest import cpu_env
from torch import nn

pytestmark = pytest.mark.usefixtures('cpu_ranks')

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
DTNB = str(Path(PY).parent / 'dtnb')
ENV = cpu_env(None, ROOT)  # DTNB_DEVICE=cpu for the subprocesses too
SCRIPT = 'tests/scripts/train_ckpt.py'


def _run(args, timeout=240):
    r = subprocess.run([DTNB, 'launch', '-n', '2', *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads([l for l in r.stdout.splitlines() if l.startswith('{')][-1]), r.stdout + r.stderr


@pytest.mark.long  # the resume tutorial kills and restarts the same script: bash run.sh test-long
def test_sigkill_restart_resumes_bitwise(tmp_path):
    "One rank SIGKILLs itself at step 7 of 12; torchrun restarts the group; fit resumes at 6, ends as a clean run"
    from dtnb.launcher.processes import launch
    from dtnb.train.checkpoint import list_checkpoints
    from dtnb.train.export import load_exported
    sys.path.insert(0, str(ROOT / 'tests' / 'scripts'))
    from train_ckpt import train
    ref = launch(train, 12, 3, str(tmp_path / 'ref'), str(tmp_path / 'ref.pt'),
                 nprocs=2)[0]  # the same script, never killed
    got, log = _run(['--max-restarts=1', SCRIPT, '--dir', str(tmp_path / 'ck'), '--out', str(tmp_path / 'got.pt'),
                     '--kill-at', '7'])
    assert 'rank 1: SIGKILL at step 7' in log
    assert (ref['attempt'], ref['start_step']) == (0, 0)
    assert (got['attempt'], got['start_step'], got['steps']) == (1, 6, 12)
    assert got['resumed_from'].endswith('step_00000006')
    assert got['losses'] == ref['losses']  # all 12, the first 6 from the checkpoint
    a, b = load_exported(tmp_path / 'ref.pt'), load_exported(tmp_path / 'got.pt')
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert [c['step'] for c in list_checkpoints(tmp_path / 'ck').complete] == [9, 12]


def _pipeline_run(schedule, steps, ckdir, out):
    "Train ToyModel as a 2-rank pipeline with fit (resuming from `ckdir`), export it; return losses, start, rank state"
    from dtnb.parallel.ddp import distributed_loader
    from dtnb.parallel.wrap import wrap
    from dtnb.core.models import ToyModel, toy_data
    from dtnb.train.loop import fit
    from dtnb.train.export import export_model
    torch.manual_seed(0)
    pipe = wrap(ToyModel(), 'pipeline', loss_fn=nn.functional.mse_loss, n_microbatches=4, schedule=schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    loader = distributed_loader(toy_data(96), batch_size=16, shuffle=True, num_replicas=1,
                                rank=0)  # every stage reads the batch
    r = fit(pipe, loader, opt, epochs=2, max_steps=steps, progress=False, checkpoint_dir=ckdir)
    export_model(out, pipe)
    state = {f"{n}.{k}": v.clone() for m in pipe.modules for n, p in m.named_parameters() for k,
             v in opt.state[p].items()}
    return r.losses, r.start_step, len(pipe.modules), state


def _pipeline_load(schedule, ckdir, out):
    "Load a pipeline checkpoint into another split of the model, then export it"
    from dtnb.parallel.wrap import wrap
    from dtnb.core.models import ToyModel
    from dtnb.train.checkpoint_load import load_checkpoint
    from dtnb.train.export import export_model
    pipe = wrap(ToyModel(seed=5), 'pipeline', loss_fn=nn.functional.mse_loss, n_microbatches=4, schedule=schedule)
    load_checkpoint(ckdir, pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2))
    export_model(out, pipe)


def test_pipeline_resumes_bitwise_and_loads_in_any_split(tmp_path):
    """Interleaved pipeline (two stages per rank): stop at 5, resume to 10 = 10 straight; the checkpoint loads on one
    process and in another split"""
    from dtnb.launcher.processes import launch
    from dtnb.core.models import ToyModel
    from dtnb.train.checkpoint_load import load_checkpoint
    from dtnb.train.export import load_exported
    ck = str(tmp_path / 'ck')
    straight = launch(_pipeline_run, 'interleaved1f1b', 10, None, tmp_path / 'straight.pt', nprocs=2)
    launch(_pipeline_run, 'interleaved1f1b', 5, ck, tmp_path / 'half.pt', nprocs=2)
    resumed = launch(_pipeline_run, 'interleaved1f1b', 10, ck, tmp_path / 'resumed.pt', nprocs=2)
    assert [r[2] for r in resumed] == [2, 2] and [r[1] for r in resumed] == [5, 5]
    assert resumed[0][0] == straight[0][0] and len(straight[0][0]) == 10
    a, b = load_exported(tmp_path / 'straight.pt'), load_exported(tmp_path / 'resumed.pt')
    assert set(a) == set(ToyModel().state_dict()) and all(torch.equal(a[k], b[k]) for k in a)
    # one process, the whole model: the weights and the optimizer state the stages held
    model = ToyModel(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_checkpoint(ck, model, opt).saved_ranks == 2
    assert all(torch.equal(model.state_dict()[k], b[k]) for k in b)
    state = {k: v for r in resumed for k, v in r[3].items()}
    got = {f"{n}.{k}": v for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    assert set(got) == set(state) and all(torch.equal(got[k], state[k]) for k in state)
    # two ranks cut into one stage each
    launch(_pipeline_load, '1f1b', ck, tmp_path / 'other.safetensors', nprocs=2)
    c = load_exported(tmp_path / 'other.safetensors')
    assert all(torch.equal(c[k], b[k]) for k in b)


def test_resume_with_loader_workers_and_own_generator():
    "A shuffled DataLoader with 2 workers and its own generator resumes mid-epoch on the same batches"
    from torch.utils.data import DataLoader, TensorDataset
    from dtnb.train.resume_state import resumable, rng_state, set_rng_state
    ds = TensorDataset(torch.arange(40))
    def make(): return resumable(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                            generator=torch.Generator().manual_seed(1)))
    a = make()
    it = iter(a)
    head = [next(it)[0].tolist() for _ in range(4)]
    pos, rng = a.state_dict(), rng_state()
    straight = [b[0].tolist() for b in it] + [b[0].tolist() for b in a]
    b = make()
    b.load_state_dict(pos); set_rng_state(rng)
    resumed = [x[0].tolist() for x in b] + [x[0].tolist() for x in b]
    assert resumed == straight and len(straight) == 6 + 10
    assert sorted(sum(head + straight[:6], [])) == list(range(40))


def _bn_run(steps, ckdir):
    "Train the BatchNorm CNN under DDP twice, buffers broadcast from rank 0 (default) and kept per rank; every state"
    sys.path.insert(0, str(ROOT / 'tests'))
    from models_cnn import tiny_cnn, tiny_images
    from dtnb.parallel.ddp import distributed_loader
    from dtnb.parallel.wrap import wrap
    from dtnb.train.loop import fit
    out = {}
    for bb in (True, False):
        m = wrap(tiny_cnn(), 'ddp', broadcast_buffers=bb)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        loader = distributed_loader(tiny_images(), batch_size=8)
        fit(m, loader, opt, nn.functional.cross_entropy, epochs=3, max_steps=steps, progress=False,
            checkpoint_dir=ckdir and f"{ckdir}/{bb}")
        out[bb] = {k: v.clone() for k, v in m.module.state_dict().items()}
    return out


def test_batchnorm_ddp_resumes_bitwise_buffers_included(tmp_path):
    "BatchNorm CNN, 2 DDP ranks: stop at 3, resume to 7 = 7 straight, parameters and running statistics, on every rank"
    from dtnb.launcher.processes import launch
    ck = str(tmp_path / 'ck')
    straight = launch(_bn_run, 7, None, nprocs=2)
    launch(_bn_run, 3, ck, nprocs=2)
    resumed = launch(_bn_run, 7, ck, nprocs=2)
    for r in range(2):
        for bb in (True, False):
            a, b = straight[r][bb], resumed[r][bb]
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), (r, bb,
                [k for k in a if not torch.equal(a[k], b[k])])
    # without broadcasting the ranks' statistics differ: resume gave each rank its own back from its rank file
    s = straight
    assert not torch.equal(s[0][False]['1.running_mean'], s[1][False]['1.running_mean'])
    own = torch.load(Path(ck) / 'False' / 'step_00000003' / 'rank_00001.pt', weights_only=True)['buffers']
    assert '1.running_mean' in own and '1.weight' not in own


def test_stateful_dataloader_resumes_bitwise(tmp_path):
    "torchdata's StatefulDataLoader (its own state_dict) through fit(checkpoint_dir=...): stopped mid-epoch, resumed"
    sdl = pytest.importorskip('torchdata.stateful_dataloader', reason="no torchdata (the dev extra installs it)")
    from dtnb.core.models import ToyModel, toy_data
    from dtnb.train.checkpoint_load import load_checkpoint

    def run(ckpt, steps):
        torch.manual_seed(0)
        model = ToyModel()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = sdl.StatefulDataLoader(toy_data(48), batch_size=8, shuffle=True, num_workers=0)
        from dtnb.train.loop import fit
        r = fit(model, loader, opt, epochs=2, max_steps=steps, progress=False, checkpoint_dir=ckpt)
        return r, model

    n = torch.get_num_threads(); torch.set_num_threads(1)  # a tiny model: one thread
    try: whole, m1 = run(None, None); first, _ = run(tmp_path, 8); again, m2 = run(tmp_path, None)  # 6 batches/epoch
    finally: torch.set_num_threads(n)
    assert (first.start_step, again.start_step, len(again.losses)) == (0, 8, 12)
    assert again.losses == whole.losses               # the same batches in the same order, bitwise
    assert all(torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values()))
    ck = load_checkpoint(again.resumed_from, ToyModel())
    assert ck.data == dict(epoch=None, offset=2) and '2 batches served' in str(ck)  # the one it resumed from: step 8


def test_stateful_dataloader_resumed_to_the_end_of_a_pass_counts_its_epochs(tmp_path):
    "A StatefulDataLoader run resumed mid-pass (or at a pass end), stopped by max_steps at a pass end: every epoch end"
    sdl = pytest.importorskip('torchdata.stateful_dataloader', reason="no torchdata (the dev extra installs it)")
    from dtnb.core.models import ToyModel, toy_data
    from dtnb.train.callbacks import Callback
    from dtnb.train.loop import fit
    from dtnb.train.resume_state import batches_served

    class Epochs(Callback):
        def on_fit_end(self, state): self.epochs = state.epoch

    def run(ckpt, steps):  # 6 batches a pass, 3 passes asked for, stopped at `steps`
        torch.manual_seed(0)
        model = ToyModel()
        loader = sdl.StatefulDataLoader(toy_data(48), batch_size=8, shuffle=True, num_workers=0)
        cb = Epochs()
        r = fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), epochs=3, max_steps=steps, progress=False,
                checkpoint_dir=ckpt, callbacks=[cb])
        return r.losses, cb.epochs

    n = torch.get_num_threads(); torch.set_num_threads(1)
    try:
        whole = run(None, 12)
        assert whole[1] == 2
        for first in (8, 6):  # resumed mid-pass; resumed from the end of a pass whose end was counted
            assert run(tmp_path / str(first), first)[1] == 1
            assert run(tmp_path / str(first), 12) == whole, first
    finally: torch.set_num_threads(n)
    dl = sdl.StatefulDataLoader(list(range(12)), batch_size=2, num_workers=2)  # with workers: the snapshot's count
    it = iter(dl); _ = [next(it) for _ in range(3)]
    assert batches_served(dl) == 3


def _own_disk(d):
    "Mount an empty tmpfs over `d` for this process alone: a host whose checkpoint directory is its own disk"
    import ctypes, ctypes.util
    libc = ctypes.CDLL(ctypes.util.find_library('c'), use_errno=True)
    CLONE_NEWNS, MS_REC, MS_PRIVATE = 0x20000, 0x4000, 1 << 18
    if (libc.unshare(CLONE_NEWNS) or libc.mount(b'none', b'/', None, MS_REC | MS_PRIVATE, None)
            or libc.mount(b'tmpfs', str(d).encode(), b'tmpfs', 0, None)):
        return os.strerror(ctypes.get_errno())


def _hosts_without_a_shared_dir(root):
    "Rank 1 sees its own empty `root/own`: it loads, saves, loads what differs from rank 0's, resumes a fit"
    from dtnb.core.dist import rank
    from dtnb.core.models import ToyModel, toy_data
    from dtnb.parallel.ddp import distributed_loader
    from dtnb.train.loop import fit
    from dtnb.parallel.wrap import wrap
    from dtnb.train.checkpoint import save_checkpoint, checkpoint_path, CheckpointError
    from dtnb.train.checkpoint_load import load_checkpoint
    root = Path(root)
    if rank() == 1 and (why := _own_disk(root / 'own')): return why
    model = wrap(ToyModel(), 'ddp')
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msgs = []
    loader = distributed_loader(toy_data(32), batch_size=8)
    for f in (lambda: load_checkpoint(root / 'own' / 'ck', model, opt),
              lambda: save_checkpoint(checkpoint_path(root / 'own' / 'new', 1), model, opt, step=1),
              lambda: load_checkpoint(root / ('a' if rank() == 0 else 'b'), model, opt),
              lambda: fit(model, loader, opt, max_steps=1, progress=False, checkpoint_dir=root / 'own' / 'ck')):
        try: f(); msgs.append('done')
        except CheckpointError as e: msgs.append(str(e))
    return msgs, sorted(os.listdir(root / 'own' / 'new'))


def test_hosts_without_a_shared_directory_are_told_on_every_rank(tmp_path):
    "A checkpoint directory that is each host's own disk: loading and saving raise on every rank, naming it, no hang"
    from dtnb.core.models import ToyModel
    from dtnb.launcher.processes import launch
    from dtnb.train.checkpoint import save_checkpoint, checkpoint_path
    if os.geteuid() != 0: pytest.skip("a rank's own view of a directory needs root (unshare and mount)")
    m = ToyModel()
    for d in ('own/ck', 'a', 'b'): save_checkpoint(checkpoint_path(tmp_path / d, 1), m, step=1)  # one process
    out = launch(_hosts_without_a_shared_dir, str(tmp_path), nprocs=2)
    if isinstance(out[1], str): pytest.skip(f"no mount namespace for a rank here: {out[1]}")
    (load, save, mixed, resume), (load1, save1, mixed1, resume1) = out[0][0], out[1][0]
    assert (load, save, mixed, resume) == (load1, save1, mixed1, resume1)
    assert load.startswith("nothing was loaded; rank 1: FileNotFoundError: checkpoint ") and "does not exist" in load
    assert load.endswith("the other ranks could: load from a directory every host shares (NFS, Lustre, ...)")
    assert save == (f"nothing was saved: rank 0 cannot see rank 1's __1_0.distcp, rank_00001.pt in {tmp_path}/own/new: "
                    "save to a directory every host shares (NFS, Lustre, ...), not each host's own disk")
    assert "the ranks found different checkpoints" in mixed and "pass the same one on every rank" in mixed, mixed
    assert resume == (f"the ranks found different newest checkpoints in {tmp_path}/own/ck (rank 0: step_00000001, "
                      "rank 1: none): resume from a directory every host shares (NFS, Lustre, ...)"), resume
    assert out[0][1] == out[1][1] == []  # no temporary directory left on either "host"
