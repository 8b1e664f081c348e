"""allow_unsafe's refusal (tasks/rewards/unsafe_mode.py): where a program would keep the trainer's uid, any
credential it could read refuses the mode."""

from grpoflow.tasks.rewards.unsafe_mode import unsafe_refusal


def test_allow_unsafe_is_refused_where_a_program_would_keep_the_trainers_uid_and_credentials(tmp_path) -> None:
    """Not root, rlimits mode runs programs as the trainer's uid: refused while a credential-like variable is
    in a readable environment or a credential file is readable; as root (own uids per run) allowed."""
    clean = [{"PATH": "/usr/bin", "HOME": str(tmp_path)}]
    assert unsafe_refusal(euid=0, environs=[{"AWS_SECRET_ACCESS_KEY": "x"}], home=tmp_path) is None
    assert unsafe_refusal(euid=1000, environs=clean, home=tmp_path) is None
    for name in ("AWS_ACCESS_KEY_ID", "HF_TOKEN", "MLFLOW_TRACKING_PASSWORD", "OPENAI_API_KEY", "GITHUB_TOKEN"):
        reason = unsafe_refusal(euid=1000, environs=[*clean, {name: "x"}], home=tmp_path)
        assert reason and name in reason
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    reason = unsafe_refusal(euid=1000, environs=clean, home=tmp_path)
    assert reason and ".aws/credentials" in reason
