"""Comparing runs in MLflow, as a user does: two micro pipelines that differ in one key (grpo.learning_rate), logged
to a real `mlflow server`; then

- mlflow.search_runs filtered to the grpo stage returns both, with that key as a param and every reward series;
- the registered model's champion loads with mlflow.pyfunc and answers a prompt;
- the MLflow UI, in a real headless Chromium (Debian's chromium + chromium-driver, selenium), in the model-training
  view: the grpo runs' comparison shows the differing learning rates, and the charts view shows the reward charts.
  Screenshots go to $GRPOFLOW_TEST_ARTIFACTS (default <tmp>/screenshots); .ci/run installs the browser.
"""

import contextlib
import json
import os
import shutil
import time
import urllib.parse
from pathlib import Path

import mlflow
import pytest
from mlflow.tracking import MlflowClient

from grpoflow.flows.cli import main
from grpoflow.tasks.config import load_config
from tests.paths import MICRO

EXPERIMENT = "compare-ui"
LRS = ("1e-3", "5e-4")
ML_VIEW = "workflowType=machine_learning"


@pytest.fixture(scope="module")
def two_runs(mlflow_server, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    base = [
        "run",
        str(MICRO),
        f"run.output_dir={out}",
        f"tracking.uri={mlflow_server}",
        f"tracking.experiment={EXPERIMENT}",
    ]
    for i, lr in enumerate(LRS):
        assert main([*base, f"run.name=lr-{i}", f"grpo.learning_rate={lr}"]) == 0
    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name(EXPERIMENT)
    return mlflow_server, exp.experiment_id


@pytest.fixture(autouse=True)
def _global_tracking_uri_restored():
    """mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI for the whole process: left set, every later test's
    pipeline would track to this module's server after it stopped (minutes of the client's retries each)."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    mlflow.set_tracking_uri(before)  # None unsets the variable and the global


def grpo_runs(uri: str, exp: str):
    mlflow.set_tracking_uri(uri)
    return mlflow.search_runs([exp], filter_string="tags.stage = 'grpo'", order_by=["params.learning_rate DESC"])


@pytest.mark.slow
def test_grpo_runs_hold_their_settings_and_reward_series(two_runs):
    uri, exp = two_runs
    df = grpo_runs(uri, exp)
    assert len(df) == 2 and list(df["params.learning_rate"]) == ["0.001", "0.0005"]
    assert set(df["params.loss_type"]) == {"dapo"} and set(df["params.model"]) == {"tiny"}
    assert df["params.dataset_digest"].nunique() == 1 and df["params.dataset_digest"].notna().all()
    assert list(df["tags.mlflow.runName"]) == [
        "grpo · tiny · arithmetic · dapo · lr 1e-3",
        "grpo · tiny · arithmetic · dapo · lr 5e-4",
    ]
    reward_funcs = load_config(str(MICRO)).grpo.reward_funcs
    series = ["reward", "reward_std", *(f"rewards/{f}/mean" for f in reward_funcs)]
    client = MlflowClient(uri)
    for run_id in df["run_id"]:
        for name in series:
            assert len(client.get_metric_history(run_id, name)) == 3, name  # one point per step (max_steps 3)
        run = client.get_run(run_id)
        assert not any(k.startswith("clip_ratio/") for k in run.data.metrics)  # constant at these settings
        assert "0 by construction" in run.data.tags["metric_omitted.clip_ratio"]
        assert "mean reward" in run.data.tags["mlflow.note.content"]
        assert any(k.startswith("system/cpu") for k in run.data.metrics)  # system metrics, even in a short stage
        assert [d.dataset.name for d in run.inputs.dataset_inputs] == ["arithmetic-train"]
        assert len(run.outputs.model_outputs) == 1  # the trained model: a training run in every UI view
    assert client.get_experiment(exp).tags["mlflow.experimentKind"] == "custom_model_development"


@pytest.mark.slow
def test_registered_champion_loads_with_pyfunc_and_answers(two_runs):
    uri, _ = two_runs
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/grpoflow-tiny@champion")
    assert model.metadata.flavors["transformers"]["task"] == "text-generation"
    assert model.metadata.flavors["python_function"]["config"]["return_full_text"] is False
    assert model.metadata.get_input_schema() is not None and model.metadata.get_params_schema() is not None
    answer = model.predict(["What is 2 + 3?"], params={"max_new_tokens": 8})
    assert len(answer) == 1 and isinstance(answer[0], str) and answer[0]
    assert not answer[0].startswith("What is 2 + 3?")  # the completion only


def _browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.skip("chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1100"):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=opts)


def _wait_for(browser, texts: list[str], timeout: float = 60) -> str:
    deadline = time.time() + timeout
    body = ""
    while time.time() < deadline:
        body = browser.find_element("tag name", "body").text
        if all(t in body for t in texts):
            return body
        time.sleep(0.5)
    missing = [t for t in texts if t not in body]
    raise AssertionError(f"not on the page after {timeout:.0f} s: {missing}; page text starts: {body[:1500]!r}")


def _close_assistant(browser) -> None:
    """Close MLflow's assistant side panel (it takes a third of the screenshot), when it is open."""
    for button in browser.find_elements("css selector", "button[aria-label]"):
        if button.get_attribute("aria-label").lower() in ("close", "close assistant", "close panel"):
            with contextlib.suppress(Exception):
                button.click()
                time.sleep(0.5)
            return


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_browser_compares_the_grpo_runs(two_runs, tmp_path):
    uri, exp = two_runs
    shots = Path(os.environ.get("GRPOFLOW_TEST_ARTIFACTS", tmp_path)) / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    ids = list(grpo_runs(uri, exp)["run_id"])
    browser = _browser()
    try:
        runs_q = urllib.parse.quote(str(ids).replace("'", '"'))
        browser.get(f"{uri}/#/compare-runs?runs={runs_q}&experiments=%5B%22{exp}%22%5D&{ML_VIEW}")
        body = _wait_for(browser, ["learning_rate", "0.001", "0.0005", "loss_type", "reward"])
        assert "lr 1e-3" in body and "lr 5e-4" in body  # the run names say which is which
        _close_assistant(browser)
        browser.save_screenshot(str(shots / "compare-grpo-runs.png"))
        heads = browser.find_elements("xpath", "//*[normalize-space(text())='Parameters']")
        if heads:  # the params table, where the differing learning_rate row is
            browser.execute_script("arguments[0].scrollIntoView({block: 'start'});", heads[-1])
            time.sleep(1)
        switches = browser.find_elements("css selector", "[role='switch']")
        if switches:  # "Show diff only" of the params table: the row that differs
            switches[0].click()
            time.sleep(1)
        _wait_for(browser, ["learning_rate", "0.001", "0.0005"])
        browser.save_screenshot(str(shots / "compare-grpo-params.png"))

        # the reward charts of both runs (the page the comparison's metric links open): runs must come first
        keys = ["reward", *(f"rewards/{f}/mean" for f in load_config(str(MICRO)).grpo.reward_funcs)]
        query = {"runs": ids, "metric": "reward", "experiments": [exp], "plot_metric_keys": keys}
        query = "&".join(f"{k}={urllib.parse.quote(json.dumps(v, separators=(',', ':')))}" for k, v in query.items())
        browser.get(f"{uri}/#/metric/reward?{query}&{ML_VIEW}")
        _wait_for(
            browser, [f"grpo · tiny · arithmetic · dapo · lr {lr} ({k})" for lr in ("1e-3", "5e-4") for k in keys]
        )
        browser.save_screenshot(str(shots / "grpo-reward-charts.png"))
    finally:
        browser.quit()
    assert (shots / "compare-grpo-runs.png").stat().st_size > 10_000
