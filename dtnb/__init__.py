__version__ = "0.1.0"

# The public API, imported on first use so that `import dtnb` stays cheap (heavy torch.distributed submodules load
# only when the feature that needs them runs). Hand-written: nbdev only updates `__version__`.
# Each name is looked up in nbdev's index of the exported modules (`_modidx`), so a definition can move between
# notebooks without touching this file. No stage package shares a name with a public function (tests/test_api.py).
_API = '''
    detect DeviceReport parse_launch_env LaunchEnv fork_hazards
    ToyModel TinyTransformer toy_data toy_sequences find_blocks
    launch LaunchError init_distributed shutdown rank world_size local_rank is_main barrier rank0_first current_device
    placement preflight DoctorReport CollectiveTimeout
    wrap make_optimizer apply_activation_checkpointing batchnorm_layers distributed_loader float8_training
    full_state_dict check_optimizer size_groups
    apply_pipeline Pipeline causal_lm_loss split_model PipelineSplit PipelineTimeline PipelineTimelines
    simulate_schedule
    schedule_order bubble_fraction
    Degrees parallelize tp_plan apply_tp data_rank
    ulysses ulysses_data ulysses_attention
    estimate_memory estimate_layout_memory recommend measure_memory trace_activations memory_explorer
    TransformerShape MemoryEstimate
    layout_candidates step_time step_parts step_collectives dp_exposed transformer_flops Node
    MemoryPlan MemoryMeasurement
    find_batch_size BatchSize
    save_checkpoint load_checkpoint latest_checkpoint list_checkpoints checkpoint_path resumable
    export_model export_checkpoint load_exported CheckpointError
    fit FitResult FitState RankSteps evaluate Callback CSVLogger TensorBoardLogger EarlyStopping KeepBest Preemption
    FitCheckpoints FitValidation
    find_lr LRRangeTest Profiler plot_traces WandbLogger MLflowLogger
    profile_loader input_bound tune_loader loader_report SyntheticDataset StepTimer
    bench_matmul bench_memory bench_collectives bench_model bench_scaling bench_all cost_per_experiment BenchResult
    time_fn
    predict Prediction Target device_spec DeviceSpec target_node
    trace_step op_seconds sample_ops load_curves validate Validation
    report
    set_verbosity get_logger DtnbWarning PerformanceWarning EquivalenceWarning CheckpointWarning UsageWarning
    check_equivalence EquivalenceReport trace_collectives CollectiveTrace
'''.split()

def _module_of(name):
    "The dtnb submodule that defines `name`, from nbdev's index"
    from ._modidx import d
    return next((m for m, syms in d['syms'].items() if f'{m}.{name}' in syms), None)

def __getattr__(name):
    import importlib
    if name in _API:
        mod = _module_of(name)
        if mod is None: raise AttributeError(f"dtnb.{name} is listed in dtnb._API but no module defines it")
        return getattr(importlib.import_module(mod), name)
    from ._modidx import d
    if f'dtnb.{name}' in d['syms']: return importlib.import_module(f'dtnb.{name}')  # a submodule
    raise AttributeError(f"module 'dtnb' has no attribute {name!r}")

def __dir__(): return sorted(list(globals()) + _API)
