"""An S3 bucket of a test's own. The process state a test changes and gives back (environment
variables, the working folder) is testkit.process_state's."""


def new_bucket(endpoint: str) -> str:
    import uuid

    import boto3

    name = f"gallery-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name
