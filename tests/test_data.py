"""Loader profiling, the input-bound verdict and the tuner, on real DataLoaders with real worker processes and real
ranks. The CPU is the subject: ranks are CPU ranks on gloo on any machine (`cpu_ranks`, conftest.py)."""
import statistics, time
import psutil, pytest, torch
import torch.nn as nn
from conftest import mp_helper
from torch.utils.data import DataLoader
from dtnb.data.loaders import SyntheticDataset, SyntheticIterable, SampleError, cores_free, profile_loader
from dtnb.data.steps import input_bound, RankStepProfiles, StepProfile
from dtnb.data.tune import tune_loader, loader_report
from dtnb.data.trials import loader_trial, worker_limits, measure_sample_cost
from dtnb.launcher.processes import launch
from dtnb.detection.device import usable_cores

pytestmark = pytest.mark.usefixtures('cpu_ranks')


@pytest.fixture(autouse=True)
def one_thread():
    "Tests share 2 cores with other jobs: one torch thread keeps step times steady (and forked workers safe)"
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def children():
    """Child processes left behind (multiprocessing's own resource tracker and fork server, started once, are not ours);
    no gc first:
    workers must be stopped explicitly, not when the garbage collector frees an iterator held by a traceback"""
    return [c for c in psutil.Process().children(recursive=True) if not mp_helper(c)]


def side_by_side(ds, bs, best, rounds=3, trial_s=0.8):
    "Median samples/s of num_workers=0 and of `best`, measured alternately"
    zero, tuned = [], []
    for _ in range(rounds):
        zero.append(loader_trial(ds, bs, trial_s, num_workers=0).samples_per_s)
        tuned.append(loader_trial(ds, bs, trial_s, **best).samples_per_s)
    return statistics.median(zero), statistics.median(tuned)


# --- the tuner's gain, measured side by side --------------------------------------------------------------------------

@pytest.mark.long  # a measured gain: bash run.sh test-long
def test_tuner_beats_no_workers_on_cpu_bound_set():
    ds = SyntheticDataset(2048, cost_ms=2, mode='cpu')
    free = [cores_free()]
    res = tune_loader(ds, 16, trial_s=0.5)
    zero, tuned = side_by_side(ds, 16, res.best.settings)
    free.append(cores_free())
    print(f"cpu-bound set: tuned {res.best.settings} {tuned:.0f} vs num_workers=0 {zero:.0f} samples/s = "
          f"{tuned / zero:.2f}×; cores free {free}")
    if min(free) < 1.5:  # other jobs hold the cores: two workers cannot run two samples at once, whatever the settings
        pytest.skip(f"only {min(free):.2f} of 2 cores free (tuned {tuned:.0f} vs {zero:.0f} samples/s = "
                    f"{tuned / zero:.2f}×): the check needs most of two cores")
    # two workers gain at most the cores this process gets, less the main process's share (it collates and iterates):
    # idle, 1.69-1.79× on 1.83-1.91 free cores; CI once measured 1.50× on 1.73, where a fixed 1.6× failed
    assert tuned >= 0.8 * min(free) * zero, (f"tuned {res.best.settings}: {tuned:.0f} samples/s vs {zero:.0f} with "
                                             f"num_workers=0 ({tuned / zero:.2f}×; cores free {free})\n{res}")


@pytest.mark.long  # a measured gain: bash run.sh test-long
def test_tuner_beats_no_workers_more_on_io_like_set():
    ds = SyntheticDataset(2048, cost_ms=2, mode='sleep')
    cost = measure_sample_cost(ds)
    cores = worker_limits(cost, 16)['cores_per_rank']
    res = tune_loader(ds, 16, trial_s=0.5, max_workers=4 * cores)  # beyond the cores only when asked
    workers = res.best.settings['num_workers']
    assert workers > cores, res  # waiting samples use more workers than cores
    zero, tuned = side_by_side(ds, 16, res.best.settings, trial_s=0.6)
    # W workers overlap W waits, as far as the CPU part of a sample allows: half of that, measured here (one core
    # under load gave 2.9x of an ideal 4; idle, 3.9x)
    ideal = min(workers, cost.wall_ms / cost.cpu_ms)
    assert tuned >= 0.5 * ideal * zero, (f"tuned {res.best.settings}: {tuned:.0f} vs {zero:.0f} samples/s "
                                         f"({tuned / zero:.2f}×, ideal {ideal:.1f}×)\n{res}")


def test_in_memory_set_keeps_workers_at_zero():
    free = [cores_free()]
    res = tune_loader(SyntheticDataset(4096, mode='memory'), 64, trial_s=0.3)
    free.append(cores_free())
    if min(free) < 1.7:  # other jobs hold the cores: more processes get a larger share of them, so workers can win
        pytest.skip(f"only {min(free):.2f} of 2 cores free (the tuner chose {res.kwargs}): workers lose only on "
                    "idle cores")
    assert res.kwargs['num_workers'] == 0, (res, free)
    assert any('workers cost more than they save' in a for a in res.advice), res.advice


# --- the verdict -------------------------------------------------------------------------------------------------

def mlp_step(sizes):
    layers = [nn.Flatten()] + [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())][:-1]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def step(batch):
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
    return step


@pytest.mark.parametrize('mode', ['cpu', 'sleep'])
def test_fast_step_on_slow_loader_is_input_bound(mode):
    loader = DataLoader(SyntheticDataset(512, cost_ms=2, mode=mode), batch_size=16)  # >= 32 ms per batch
    p = input_bound(mlp_step([3 * 32 * 32, 10]), loader, n_steps=12, warmup=3)  # a step of about a millisecond
    assert p.input_bound and p.fraction('data') > 0.5, p
    assert p.verdict.startswith(f"input-bound: {p.fraction('data'):.0%} of step time waiting for data; "
                                "a loader at least")
    assert abs(p.speedup_needed - p.step_s / (p.mean('h2d') + p.mean('compute'))) < 1e-9


# sleeping samples: fast with many workers
@pytest.mark.parametrize('mode,cost_ms,workers', [('cpu', 0.01, 0), ('sleep', 2, 8)])
def test_slow_step_on_fast_loader_is_compute_bound(mode, cost_ms, workers):
    # The step takes 100 ms; it sleeps, as a host waiting on a GPU does. Even a loader that keeps up costs each step the
    # time to hand a batch over, and that is a fact of the machine which grows with the step: on a VM a worker process
    # idle for a whole step must first be woken (a pipe round trip took 0.2 ms hot, 1.5 ms after 100 ms idle and 6.6 ms
    # after 300 ms on one; a DataLoader hand-over, several round trips, 10-17 ms after 100 ms; with no workers, up to
    # 18 ms). So that floor is measured with the same step and workers on samples that cost nothing, and the loader
    # under test is compute-bound when it waits less than 10% of the step beyond it (no workers at 2 ms a sample: 30%);
    # a floor over half the step leaves nothing to judge.
    def step(batch): time.sleep(0.1)
    free = DataLoader(SyntheticDataset(512, cost_ms=0, mode=mode), batch_size=16, num_workers=workers)
    floor = input_bound(step, free, n_steps=8).fraction('data')
    if floor > 0.5: pytest.skip(f"handing a batch over costs {floor:.0%} of a 100 ms step here (samples cost nothing)")
    loader = DataLoader(SyntheticDataset(512, cost_ms=cost_ms, mode=mode), batch_size=16, num_workers=workers)
    p = input_bound(step, loader, n_steps=8, threshold=floor + 0.1)
    assert p.mean('compute') >= 0.1 and not p.input_bound and p.verdict.startswith('compute-bound'), (floor, p)


def test_profile_loader_map_style_and_iterable():
    p = profile_loader(DataLoader(SyntheticDataset(256, cost_ms=1, mode='sleep'), batch_size=8, num_workers=2),
                       n_batches=10)
    assert (len(p.waits), p.samples, p.warmup) == (10, 80, 4)
    assert p.first_batch_s > 0 and p.wait_pct(50) <= p.wait_pct(99) and p.bytes == 80 * (3 * 32 * 32 * 4 + 8)
    it = profile_loader(DataLoader(SyntheticIterable(64, cost_ms=0.5, mode='sleep'), batch_size=8, num_workers=2),
                        n_batches=100)
    assert it.samples == 64 - 8 * (1 + 4)  # everything but the first batch and the warm-up
    assert children() == []


def test_profile_loader_takes_a_distributed_loader():
    from dtnb.parallel.ddp import distributed_loader
    p = profile_loader(distributed_loader(SyntheticDataset(64, cost_ms=0), batch_size=8), n_batches=4)
    assert p.settings['num_workers'] == 0 and p.samples == 32


# --- bad input: errors that say what is wrong, and no worker left behind ----------------------------------------------

@pytest.mark.parametrize('call', [
    lambda ds: profile_loader(DataLoader(ds, batch_size=4)),
    lambda ds: input_bound(lambda b: None, DataLoader(ds, batch_size=4)),
    lambda ds: tune_loader(ds, 4),
])
def test_empty_dataset(call):
    with pytest.raises(ValueError, match='empty'):
        call(SyntheticDataset(0))


def test_batch_size_zero():
    with pytest.raises(ValueError, match=r'batch_size=0 must be a positive whole number'):
        tune_loader(SyntheticDataset(8), 0)
    with pytest.raises(ValueError, match='batch_size'):
        DataLoader(SyntheticDataset(8), batch_size=0)  # what profile_loader and input_bound would be given


@pytest.mark.parametrize('persistent', [False, True])
@pytest.mark.parametrize('run', ['profile', 'input_bound', 'trial', 'tune'])
def test_failing_sample_in_worker_is_named_and_workers_stop(run, persistent):
    ds = SyntheticDataset(256, cost_ms=0, fail_at=150)
    t = time.perf_counter()
    where = '' if run == 'tune' else r' \(in DataLoader worker \d\)'  # the tuner's first trial has no workers
    with pytest.raises(SampleError,
                       match=r'dataset\[150\] \(SyntheticDataset\) raised ValueError: sample 150 is corrupt' + where):
        if run == 'profile': profile_loader(DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=persistent),
                                            n_batches=100)
        elif run == 'input_bound': input_bound(lambda b: None, DataLoader(ds, batch_size=4, num_workers=2,
                                                                          persistent_workers=persistent), n_steps=100)
        elif run == 'trial': loader_trial(ds, 4, trial_s=10, num_workers=2, persistent_workers=persistent)
        else: tune_loader(ds, 4, trial_s=10)  # not among the samples the tuner looks at first: found by a trial
    assert time.perf_counter() - t < 20
    assert children() == []


@pytest.mark.parametrize('persistent', [False, True])
def test_failing_step_stops_the_workers(persistent):
    def step(batch): raise RuntimeError('step exploded')
    with pytest.raises(RuntimeError, match='step exploded'):
        input_bound(step, DataLoader(SyntheticDataset(64, cost_ms=0), batch_size=4, num_workers=2,
                                     persistent_workers=persistent))
    assert children() == []


def test_failing_sample_in_iterable_names_its_position():
    with pytest.raises(SampleError,
                       match=r'sample \d+ in worker 1 of SyntheticIterable raised ValueError: sample 37 is corrupt'):
        profile_loader(DataLoader(SyntheticIterable(64, cost_ms=0, fail_at=37), batch_size=4, num_workers=2),
                       n_batches=100)
    assert children() == []


def test_failing_sample_found_before_any_worker_starts():
    with pytest.raises(SampleError, match=r'dataset\[0\]'):
        tune_loader(SyntheticDataset(64, fail_at=0), 8)
    assert children() == []


# --- under DDP: every rank, and the slowest --------------------------------------------------------------------------

def _ddp_input_bound(slow_rank, workers):
    import torch.distributed as dist
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    def step(batch):
        x, y = batch
        nn.functional.cross_entropy(model(x), y).backward(); opt.step(); opt.zero_grad()
    slow = dist.get_rank() == slow_rank
    ds = SyntheticDataset(256, cost_ms=5, mode='sleep') if slow else SyntheticDataset(256, mode='memory')
    res = input_bound(step, DataLoader(ds, batch_size=16, num_workers=workers), n_steps=8, warmup=2)
    lim = worker_limits(measure_sample_cost(ds), 16)
    return res, lim['local_ranks'], lim['cores_per_rank']


@pytest.mark.parametrize('slow_rank,workers', [(1, 0), (0, 1)])
def test_ddp_reports_every_rank_and_the_slowest(slow_rank, workers):
    out = launch(_ddp_input_bound, slow_rank, workers, nprocs=2, timeout=120)
    (r0, ranks0, cores0), (r1, ranks1, cores1) = out
    assert isinstance(r0, RankStepProfiles) and [p.rank for p in r0.profiles] == [0, 1]
    assert r0.to_dict() == r1.to_dict()  # every rank gets every profile
    assert r0.slowest.rank == slow_rank and r0.input_bound, r0
    slow, fast = r0.profiles[slow_rank], r0.profiles[1 - slow_rank]
    assert slow.input_bound and fast.mean('data') < 0.5 * slow.mean('data'), (r0, r0.profiles)
    # the fast rank waits for the slow one in the all-reduce
    assert fast.mean('compute') > slow.mean('compute'), (r0, r0.profiles)
    assert r0.verdict.startswith(f'rank {slow_rank} is input-bound')
    assert (ranks0, cores0) == (2, max(1, usable_cores() // 2)) == (ranks1, cores1)  # each rank's share of cores
    assert children() == []


def test_rank_profiles_from_separate_runs():
    "The aggregation takes any list of per-rank profiles (e.g. gathered from separate runs)"
    loaders = [DataLoader(SyntheticDataset(64, mode='memory'), batch_size=8), DataLoader(SyntheticDataset(64,
        cost_ms=2, mode='sleep'), batch_size=8)]
    ps = [input_bound(mlp_step([3 * 32 * 32, 10]), dl, n_steps=4, warmup=1) for dl in loaders]
    agg = RankStepProfiles([StepProfile(p.steps, p.warmup, p.device, p.threshold, rank=r) for r, p in enumerate(ps)])
    assert agg.slowest.rank == 1 and 'rank 1 is input-bound' in agg.verdict
    assert '(slowest)' in str(agg)


def test_loader_report_quick():
    rep = loader_report(SyntheticDataset(512, cost_ms=2, mode='sleep'), batch_size=16, quick=True)
    cap = rep.tuning.limits['max_workers']   # the usable cores: 1 under `taskset -c 0`
    assert rep.before.input_bound, rep.before
    # what w workers can give, from the step measured before: data and compute overlap, the data wait is shared out.
    # One worker (one usable core) only hides the compute: about 1.2x here, within the tuner's noise under load
    d, c, w = rep.before.mean('data'), rep.before.mean('compute'), min(2, cap)
    if (d + c) / max(d / w, c) >= 1.5:
        assert rep.tuning.best.settings['num_workers'] >= w, (rep.tuning.limits, d, c)
    if rep.settings:   # the tuner changed the loader: it waits less for data per step (on sleeping samples
        assert rep.after.mean('data') < rep.before.mean('data'), rep   # the fraction stays near 1 either way)
    assert children() == []


def test_spawn_without_persistent_workers_is_advised():
    "Under spawn each worker imports torch: every epoch pays seconds of start-up, measured, and the advice says so"
    loader = DataLoader(SyntheticDataset(256, cost_ms=1, mode='sleep'), batch_size=8, num_workers=1,
                        multiprocessing_context='spawn')
    p = profile_loader(loader, n_batches=8)
    assert p.settings['start_method'] == 'spawn' and p.first_batch_s > 0.3, p
    assert any('1 spawn worker afresh' in a and 'persistent_workers=True' in a for a in p.advice), p.advice
    assert children() == []


# --- tuned settings that compose: per-rank workers, kwargs for DataLoader and distributed_loader, the order kept

def _epoch_labels(options, global_batch_size):
    "For each kwargs in `options`: the labels (sample indices) of this rank's share of an epoch (distributed_loader)"
    import torch.distributed as dist
    from dtnb.parallel.ddp import distributed_loader
    ds = SyntheticDataset(48, cost_ms=0, shape=(1,), n_classes=48)  # label = index
    labels = [[int(l) for _, ys in distributed_loader(ds, global_batch_size=global_batch_size, **kw) for l in ys]
              for kw in options]
    lim = worker_limits(measure_sample_cost(SyntheticDataset(4, cost_ms=0)), 8)  # local ranks from the launcher
    return labels, lim['local_ranks'], lim['max_workers'], dist.get_world_size()


def test_tuned_kwargs_compose_with_distributed_loader_and_dataloader():
    ds = SyntheticDataset(48, cost_ms=1, mode='sleep', shape=(1,), n_classes=48)  # label = index
    cores = worker_limits(measure_sample_cost(SyntheticDataset(4, cost_ms=0)), 8)['cores']
    two = tune_loader(ds, 8, trial_s=0.05, local_ranks=2, progress=False)  # tuned before launching 2 ranks
    assert two.limits['local_ranks'] == 2 and two.limits['max_workers'] == max(1, cores // 2), two.limits
    res = tune_loader(ds, 8, trial_s=0.05, progress=False, shuffle=True, timeout=60)  # one rank
    for r, cap in ((two, max(1, cores // 2)), (res, cores)):
        assert all(t.settings['num_workers'] <= cap for t in r.trials), r  # each rank's share of the cores
        assert not any(t.settings.get('in_order') is False for t in r.trials), r  # allow_reorder=False: order kept
    # the kwargs it returned, and those it would have returned had another row won (whatever this machine's load made
    # of the contest, some rows have workers): each goes unmodified into DataLoader and distributed_loader
    options = list({repr(kw): kw for kw in [res.kwargs] + [res.kwargs_for(t) for t in res.trials]}.values())
    assert any(kw['num_workers'] for kw in options), options
    assert all(kw.get('timeout') == (60 if kw['num_workers'] else None) for kw in options), options  # workers only
    assert not any({'batch_size', 'shuffle', 'sampler', 'drop_last'} & set(kw) for kw in options), options
    assert (res.batch_size, res.sampling) == (8, dict(shuffle=True))
    fast = SyntheticDataset(48, cost_ms=0, shape=(1,), n_classes=48)
    for kw in options:
        dl = DataLoader(fast, batch_size=8, **kw)  # one process
        assert [int(l) for _, ys in dl for l in ys] == list(range(48)), kw
        del dl  # its workers stop with it
    (l0, ranks0, cap0, ws0), (l1, ranks1, cap1, ws1) = launch(_epoch_labels, options, 16, nprocs=2, timeout=120)
    for a, b in zip(l0, l1):  # every sample once across the ranks, half each
        assert sorted(a + b) == list(range(48)) and len(a) == len(b) == 24
    assert (ranks0, ranks1, ws0, ws1) == (2, 2, 2, 2)
    assert cap0 == cap1 == max(1, cores // 2)  # inside the ranks, the same share as tuned from outside
    assert children() == []
