"""With this folder on PYTHONPATH and DTNB_STANDIN_GPUS=n, every Python process (nbdev-test, launched ranks, spawned
or started by torchrun) sees the stand-in GPU node of gpu_standin.py. tests/test_gpu_node.py runs the notebooks so."""
import os

if int(os.environ.get('DTNB_STANDIN_GPUS') or 0):
    import gpu_standin
    gpu_standin.apply(int(os.environ['DTNB_STANDIN_GPUS']))
