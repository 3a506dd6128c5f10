"""The integration fixtures (a module-scoped mosquitto, a fresh federation name) for the
meta-tests that rerun an integration test against a broken variant."""

from tests.integration.conftest import federation, mosquitto_broker  # noqa: F401
