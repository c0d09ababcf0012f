"""What ember writes down about its runs, in MLflow: one module per concern.

    store.py      which store (URI resolved, credentials in a URI refused, reachable before anything loads)
    values.py     keys, texts, JSON and CSV as MLflow keeps them; a failure as a record and tags
    tracker.py    one experiment in one store, and the one write path (live, or to the outbox)
    outbox.py     a run's records kept on disk while the server is away, and their upload
    heartbeat.py  who runs a run, its heartbeat, and the repair of runs whose process died
    run.py        one run's record (`RunRecord`), or `NullRecord` when recording is off
    sweep.py      a sweep: its parent run, what it hands its jobs, and its close

The runner and the studies hand this package what to record (settings as plain values, a summary
function); nothing here imports them (tests/test_layering.py).
"""
