#!/bin/sh
# One-shot setup of the Prefect server for the local stack (docker/compose.yaml service `prefect-init`), safe to rerun:
# the work pools grpoflow-process (process worker) and grpoflow-docker-gpu (Docker worker, GPU job template from
# infra/work-pools/docker-gpu.json), and the Secret blocks from which docker-gpu.json fills AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY in flow-run containers. Needs PREFECT_API_URL and the two AWS variables.
set -eu
WORK_POOLS_DIR="${WORK_POOLS_DIR:-/work-pools}"
prefect work-pool create grpoflow-process --type process --overwrite
prefect work-pool create grpoflow-docker-gpu --type docker --base-job-template "$WORK_POOLS_DIR/docker-gpu.json" --overwrite
python -c '
import os
from prefect.blocks.system import Secret
Secret(value=os.environ["AWS_ACCESS_KEY_ID"]).save("grpoflow-s3-access-key-id", overwrite=True)
Secret(value=os.environ["AWS_SECRET_ACCESS_KEY"]).save("grpoflow-s3-secret-access-key", overwrite=True)
print("Secret blocks grpoflow-s3-access-key-id and grpoflow-s3-secret-access-key saved")
'
