"""WandbLogger and MLflowLogger offline (W&B's offline mode, MLflow's local file store): the runs hold fit's values, a
resumed fit goes on in the same run, and on 2 ranks only the main rank logs. They skip where the optional packages
are missing (`pip install 'dtnb[trackers]'`). The CPU is the subject: CPU ranks on gloo (`cpu_ranks`, conftest.py)."""
import json, os
import pytest, torch
from dtnb.core.models import ToyModel, toy_data
from dtnb.launcher.processes import launch
from dtnb.parallel.ddp import distributed_loader
from dtnb.parallel.wrap import wrap
from dtnb.train.loop import fit
from dtnb.train.trackers import WandbLogger, MLflowLogger

pytestmark = pytest.mark.usefixtures('cpu_ranks')


def train(ckpt, steps, trackers, strategy='single'):
    torch.manual_seed(0)
    model = wrap(ToyModel(), strategy)
    loader = distributed_loader(toy_data(64), global_batch_size=16, shuffle=False)
    val = distributed_loader(toy_data(32, seed=1), global_batch_size=16, shuffle=False)
    return fit(model, loader, torch.optim.SGD(model.parameters(), lr=0.05), epochs=3, max_steps=steps,
               progress=False, checkpoint_dir=ckpt, val_loader=val, callbacks=trackers)


def mlflow_runs(uri):
    from mlflow.tracking import MlflowClient
    c = MlflowClient(uri)
    exp = c.get_experiment_by_name('dtnb')
    return c, ([r.info.run_id for r in c.search_runs([exp.experiment_id])] if exp else [])


def test_mlflow_file_store_resumes_the_run(tmp_path, monkeypatch):
    pytest.importorskip('mlflow', reason="no mlflow (pip install 'dtnb[trackers]')")
    monkeypatch.setenv('MLFLOW_ALLOW_FILE_STORE', 'true')  # MLflow 3 keeps its local file store behind this switch
    uri = (tmp_path / 'mlruns').as_uri()
    train(tmp_path / 'ck', 5, [MLflowLogger(uri)])
    res = train(tmp_path / 'ck', 12, [MLflowLogger(uri)])           # resumes at step 5: the same run goes on
    c, runs = mlflow_runs(uri)
    assert res.start_step == 5 and len(runs) == 1
    loss = c.get_metric_history(runs[0], 'train/loss')
    assert [m.step for m in loss] == list(range(1, 13)) and [m.value for m in loss] == pytest.approx(res.losses)
    val = c.get_metric_history(runs[0], 'val/val_loss')
    assert [m.step for m in val] == [4, 8, 12] and [m.value for m in val] == pytest.approx(
        [v['val_loss'] for v in res.validations])
    assert c.get_run(runs[0]).info.status == 'FINISHED'


def test_wandb_offline_resumes_the_run(tmp_path, monkeypatch):
    pytest.importorskip('wandb', reason="no wandb (pip install 'dtnb[trackers]')")
    monkeypatch.setenv('WANDB_MODE', 'offline'); monkeypatch.setenv('WANDB_DIR', str(tmp_path))
    monkeypatch.setenv('WANDB_SILENT', 'true')
    first, second = WandbLogger(), WandbLogger()
    train(tmp_path / 'ck', 5, [first])
    res = train(tmp_path / 'ck', 12, [second])
    assert res.start_step == 5 and first.run_id == second.run_id          # the same run, resumed
    import wandb
    wandb.teardown()  # W&B's service writes offline files in the background: done once it is stopped, as at exit
    runs = sorted(d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-'))
    assert len(runs) == 2 and all(d.endswith(first.run_id) for d in runs)
    # the offline run files (W&B's protobuf records) hold each logged value as JSON text: the first run its 5 steps'
    # losses, the resumed one the rest and the validations
    held = [(tmp_path / 'wandb' / d / f'run-{first.run_id}.wandb').read_bytes() for d in runs]
    assert all(b'train/loss' in h and b'train/lr' in h for h in held), [len(h) for h in held]
    assert all(json.dumps(l).encode() in held[0] for l in res.losses[:5])
    assert all(json.dumps(l).encode() in held[1] for l in res.losses[5:])
    assert json.dumps(res.validations[-1]['val_loss']).encode() in held[1]


def _ranked(uri, ckpt):
    os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'
    return train(ckpt, 4, [MLflowLogger(uri)], 'ddp').losses


def test_mlflow_main_rank_only(tmp_path):
    pytest.importorskip('mlflow', reason="no mlflow (pip install 'dtnb[trackers]')")
    uri = (tmp_path / 'mlruns').as_uri()
    losses = launch(_ranked, uri, str(tmp_path / 'ck'), nprocs=2)[0]
    os.environ['MLFLOW_ALLOW_FILE_STORE'] = 'true'
    c, runs = mlflow_runs(uri)
    assert len(runs) == 1                                                 # one run, from rank 0
    assert [m.value for m in c.get_metric_history(runs[0], 'train/loss')] == pytest.approx(losses)
