"""How one layer call moves its tokens: the engines.

select.py         ``select_engine``: plain or overlap pipeline (``PipelineConfig``), the experts' row
                  layout (``EngineChoice``, frozen, one per layer); ``check_options`` (also run by the flags)
plan.py           ``DispatchPlan``: everything combine needs to undo dispatch (frozen, one per call);
                  ``RowLayout``: how expert calls get their rows
plain.py          the plain engine: dispatch, experts, combine as Megatron's six phases
pipeline_plan.py  ``MinibatchPolicy`` (one per layer) and ``PipelinePlan`` (one per call): minibatches, local
                  regions, send splits (exact or sync-free)
pipeline.py       the overlap engine: deduplicated dispatch -> experts -> combine over minibatches,
                  forward and backward, on the communication stream of the layer's ``PipelineRuntime``
tile_compose.py   one layer's expert forward and backward composed on the tile-level overlap kernels (or
                  their references): the tiles engine's and benchmarks/tile_layer.py's
"""
