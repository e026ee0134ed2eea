"""Where alerts go: a Slack-compatible webhook, or Slack itself through dagster-slack."""


from dagster import ConfigurableResource, EnvVar
from pydantic import Field

from eagle3_assets.core.serving.alerts import Alert, AlertDeliveryError, post_webhook
from eagle3_assets.core.settings.environment import ALERT_WEBHOOK_URL, SLACK_BOT_TOKEN, SLACK_CHANNEL, UI_BASE_URL

WEBHOOK_ENV = ALERT_WEBHOOK_URL.name
SLACK_TOKEN_ENV = SLACK_BOT_TOKEN.name


class AlertChannel(ConfigurableResource):
    """The alert destination. Both secrets come from environment variables; neither is ever logged."""

    webhook_url: str | None = Field(default=None, description=f"Slack-compatible incoming webhook (set from ${WEBHOOK_ENV})")
    slack_token: str | None = Field(default=None, description=f"Slack bot token (set from ${SLACK_TOKEN_ENV}); needs dagster-slack")
    slack_channel: str = Field(default=SLACK_CHANNEL.default, description=f"channel used with the Slack token (set from ${SLACK_CHANNEL.name})")
    ui_base_url: str = Field(default=UI_BASE_URL.default, description=f"the Dagster UI, for links to runs (set from ${UI_BASE_URL.name})")

    @property
    def configured(self) -> bool:
        return bool(self.webhook_url or self.slack_token)

    def run_link(self, run_id: str) -> str:
        return f"{self.ui_base_url.rstrip('/')}/runs/{run_id}"

    def send(self, alert: Alert) -> None:
        """Deliver one alert or raise :class:`AlertDeliveryError` (the sensor retries it next tick)."""
        if self.slack_token:
            try:
                from dagster_slack import SlackResource
            except ImportError as exc:
                raise AlertDeliveryError("a Slack token is set but dagster-slack is not installed (pip install dagster-slack)") from exc
            try:
                SlackResource(token=self.slack_token).get_client().chat_postMessage(
                    channel=self.slack_channel, text=alert.slack_payload()["text"]
                )
            except Exception as exc:  # the Slack SDK has its own error types; none may crash a sensor
                raise AlertDeliveryError(f"Slack rejected the alert ({type(exc).__name__})") from None
        if self.webhook_url:
            post_webhook(self.webhook_url, alert)


def alert_channel_from_env() -> AlertChannel:
    """Bind the secrets through ``EnvVar`` only when they are set, so an unset one is not an error."""
    return AlertChannel(
        webhook_url=EnvVar(WEBHOOK_ENV) if ALERT_WEBHOOK_URL.is_set() else None,
        slack_token=EnvVar(SLACK_TOKEN_ENV) if SLACK_BOT_TOKEN.is_set() else None,
        slack_channel=SLACK_CHANNEL.get(),
        ui_base_url=UI_BASE_URL.get(),
    )
