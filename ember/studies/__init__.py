"""Study results: aggregates with their uncertainty (`aggregate`), figures of them (`figures`), and the
summary a sweep's parent run gets of its children (`summary`). Knows MLflow's client, nothing of Hydra."""
