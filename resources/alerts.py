"""Where alerts go: a Slack-compatible webhook, or Slack itself through dagster-slack."""

import os

from dagster import ConfigurableResource, EnvVar
from pydantic import Field

from eagle3_assets.core.alerts import Alert, AlertDeliveryError, post_webhook

WEBHOOK_ENV = "EAGLE3_ALERT_WEBHOOK_URL"
SLACK_TOKEN_ENV = "EAGLE3_SLACK_BOT_TOKEN"


class AlertChannel(ConfigurableResource):
    """The alert destination. Both secrets come from environment variables; neither is ever logged."""

    webhook_url: str | None = Field(default=None, description=f"Slack-compatible incoming webhook (set from ${WEBHOOK_ENV})")
    slack_token: str | None = Field(default=None, description=f"Slack bot token (set from ${SLACK_TOKEN_ENV}); needs dagster-slack")
    slack_channel: str = Field(default="#eagle3-alerts", description="channel used with the Slack token")
    ui_base_url: str = Field(default="http://127.0.0.1:3000", description="the Dagster UI, for links to runs")

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
        webhook_url=EnvVar(WEBHOOK_ENV) if os.environ.get(WEBHOOK_ENV) else None,
        slack_token=EnvVar(SLACK_TOKEN_ENV) if os.environ.get(SLACK_TOKEN_ENV) else None,
        slack_channel=os.environ.get("EAGLE3_SLACK_CHANNEL", "#eagle3-alerts"),
        ui_base_url=os.environ.get("EAGLE3_UI_BASE_URL", "http://127.0.0.1:3000"),
    )
