"""Credentials in URIs (tasks/config/secrets.py): found whatever their form (user:password, a token alone, a
secret query value), redacted in what is written, refused in the config, and found again from the environment."""

from __future__ import annotations

import pytest

from grpoflow.tasks.config import ConfigError, config_from_dict
from grpoflow.tasks.config.secrets import real_uri, redact, unredact, uri_credentials, without_userinfo


@pytest.mark.parametrize(
    ("uri", "redacted", "kind"),
    [
        ("https://alice:s3cret@mlflow.example.com/", "https://***@mlflow.example.com/", "a user:password"),
        ("https://ghp_TOKEN123@mlflow.example.com:5000", "https://***@mlflow.example.com:5000", "a user name or token"),
        ("http://host/api?token=abc&x=1", "http://host/api?token=***&x=1", "a secret query parameter"),
        ("http://host/?X-Amz-Signature=f00&access_key=k", "http://host/?X-Amz-Signature=***&access_key=***", None),
        ("http://mlflow:5000", "http://mlflow:5000", None),
        ("s3://bucket/runs/a@b", "s3://bucket/runs/a@b", None),  # an '@' in the path is no userinfo
        ("sqlite:////tmp/mlflow.db", "sqlite:////tmp/mlflow.db", None),
    ],
)
def test_redact_and_classify(uri, redacted, kind):
    assert redact(uri) == redacted
    if kind is not None:
        assert uri_credentials(uri) == kind
    elif redacted == uri:
        assert uri_credentials(uri) is None
    assert "s3cret" not in redact(f"server {uri} does not answer") and "TOKEN123" not in redact(f"at {uri}.")


def test_unredact_finds_the_real_uri_in_the_environment_or_the_candidates(monkeypatch):
    real = "https://bob:pw@mlflow.example.com"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", real)
    assert unredact(redact(real)) == real
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://other:pw@elsewhere")
    assert unredact(redact(real)) == redact(real)  # another server's secret is never substituted
    assert unredact(redact(real), real) == real
    assert unredact("http://plain:5000") == "http://plain:5000"
    assert without_userinfo(real + "/health") == "https://mlflow.example.com/health"


@pytest.mark.parametrize("uri", ["https://sekrit@mlflow.example.com", "https://u:sekrit@h", "https://h/?token=sekrit"])
def test_the_config_refuses_any_credential_in_a_uri_without_echoing_it(uri):
    with pytest.raises(ConfigError, match=r"tracking.uri: holds .* in the URI") as info:
        config_from_dict({"tracking": {"uri": uri}})
    assert "sekrit" not in str(info.value) and "***" in str(info.value)


def test_real_uri_refuses_a_still_redacted_uri_naming_who_and_where(monkeypatch):
    real = "https://alice:s3cret@mlflow.example.com/"
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match=r"grpoflow compare needs the real URI in \$MLFLOW_TRACKING_URI or --x"):
        real_uri(redact(real), None, who="grpoflow compare", also=" or --x")
    assert real_uri(redact(real), real, who="w") == real
    monkeypatch.setenv("MLFLOW_TRACKING_URI", real)
    assert real_uri(redact(real), who="w") == real
    assert real_uri("http://plain:5000", who="w") == "http://plain:5000"
