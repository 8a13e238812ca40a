"""Airflow operators for cedana-airflow (shipped as cedana_airflow.operators); they arrive with the operators issue."""

__all__: list[str] = []
