-- The Prefect server's own database, beside MLflow's (created by POSTGRES_DB).
CREATE DATABASE prefect;
