-- Runs once, when the Postgres volume is first created: MLflow uses POSTGRES_DB (mlflow); Prefect gets its own database.
CREATE DATABASE prefect;
