"""marft_lg.tracking: runs, metrics, plots, reports and adapter lineage in the trackers teams already use
(TensorBoard, MLflow, Weights & Biases offline), and a registry version exported as a plain PEFT adapter or a
merged model.

Modules: `settings` (`report_to` values, the extras), `base` (the `Tracker` protocol, `open_tracker`, the guard
that keeps a failing tracker from stopping training), one module per backend (`tensorboard_backend`,
`mlflow_backend`, `wandb_backend`, each importing its package only when chosen), `lineage` (what each published
or promoted adapter version came from; the MLflow model registry kept in step with the registry's aliases),
`export` (`marft-lg export`), `commands`. Names below are imported on first use.
"""

from __future__ import annotations

from marft_lg._lazy import lazy_exports

_EXPORTS = {
    "Tracker": ".base", "NullTracker": ".base", "open_tracker": ".base", "flat_metrics": ".base",
    "check_report_to": ".settings", "TrackingUnavailable": ".settings",
    "adapter_lineage": ".lineage", "record_published": ".lineage", "record_alias_change": ".lineage",
    "export_version": ".export", "ExportError": ".export",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
