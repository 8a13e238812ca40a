"""Airflow sensors for cedana-airflow (shipped as cedana_airflow.sensors); they arrive with the operators issue."""

__all__: list[str] = []
