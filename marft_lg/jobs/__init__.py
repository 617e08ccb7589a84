"""marft_lg.jobs: scheduled retraining (mine -> train -> shadow compare -> promote) with a watermark,
a single-flight lock and a SQLite run store.

`config.RetrainJob` (job.yaml), `pipeline.run_once` (one run), `scheduler.RetrainScheduler` (cron),
`store.JobStore` (run records + watermarks), `lock.RunLock`, `stages.LibraryStages` (the real stages).
Nothing is imported here so that `marft-lg --help` stays fast.
"""
