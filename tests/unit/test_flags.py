"""service/flags.py: the settings' groups, which `serve --help` and docs/configuration.md both show."""

from service.config import Settings
from service.flags import GROUPS, setting_groups


def test_every_setting_is_in_exactly_one_group_and_no_group_names_a_setting_that_is_not():
    named = [name for _, names in GROUPS for name in names]
    assert sorted(named) == sorted(Settings.model_fields), set(named) ^ set(Settings.model_fields)
    assert len(named) == len(set(named))
    assert setting_groups() == GROUPS  # nothing left over for "Other"
    assert all(title and title[0].isupper() for title, _ in GROUPS)
