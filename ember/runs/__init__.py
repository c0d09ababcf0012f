"""The jobs behind `python -m ember.run`, one module per concern.

    job.py      where a job sits (single run or sweep job, launcher, parallel workers) and its threads
    models.py   the per-process cache of loaded models (a sweep's jobs in one process load once)
    prepare.py  validation of a job before any weight is read: config, model metadata, experiments, prompt
    effect.py   the clean-model comparison of interventions (`effect.*` metrics)
    records.py  the MLflow side of one job (its run in `ember.records`, model tags, generation metrics)
    execute.py  one job end to end, with its exit status
    sweep_callback.py  the Hydra callback of a sweep, handing it to `ember.records.sweep`

`ember.run` is the Hydra entry point on top of these; nothing here imports it.
"""
