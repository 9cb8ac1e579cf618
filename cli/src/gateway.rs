//! The gateway's API as conveyorctl calls it: one client with the token, answers as JSON,
//! refusals as errors that keep the API's code and message.

use std::fmt;

use anyhow::Context;
use serde_json::Value;

/// A refusal from the gateway: its status, stable code and message.
#[derive(Debug)]
pub struct Refused {
    pub status: u16,
    pub code: String,
    pub message: String,
}

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({} {})", self.message, self.status, self.code)
    }
}

impl std::error::Error for Refused {}

pub struct Gateway {
    pub http: reqwest::Client,
    pub base: String,
}

impl Gateway {
    pub async fn get(&self, path: &str, query: &[(&str, String)]) -> anyhow::Result<Value> {
        let request = self.http.get(format!("{}{path}", self.base)).query(query);
        self.answer(request).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> anyhow::Result<Value> {
        let request = self.http.post(format!("{}{path}", self.base)).json(body);
        self.answer(request).await
    }

    async fn answer(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let response = request
            .send()
            .await
            .with_context(|| format!("cannot reach the gateway at {}", self.base))?;
        let status = response.status();
        let body: Value = response
            .json()
            .await
            .with_context(|| format!("the gateway's answer ({status}) is not JSON"))?;
        if status.is_success() {
            return Ok(body);
        }
        let error = &body["error"];
        Err(Refused {
            status: status.as_u16(),
            code: error["code"].as_str().unwrap_or("unknown").to_owned(),
            message: error["message"].as_str().unwrap_or("refused").to_owned(),
        }
        .into())
    }
}
