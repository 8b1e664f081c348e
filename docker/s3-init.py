"""One-shot bucket creation for the local stack (docker/compose.yaml service `s3-init`): waits for the S3 endpoint,
then creates $S3_BUCKET unless it exists. Needs AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY."""

import os
import sys
import time

import boto3
from botocore.exceptions import ClientError, EndpointConnectionError

bucket = os.environ["S3_BUCKET"]
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
deadline = time.monotonic() + 120
while True:
    try:
        names = [b["Name"] for b in s3.list_buckets().get("Buckets", [])]
        break
    except (EndpointConnectionError, ClientError) as exc:
        if time.monotonic() > deadline:
            sys.exit(f"s3-init: {os.environ['AWS_ENDPOINT_URL']} not ready after 120 s: {exc}")
        time.sleep(2)
if bucket in names:
    print(f"s3-init: bucket {bucket} exists")
else:
    s3.create_bucket(Bucket=bucket)
    print(f"s3-init: created bucket {bucket}")
