//! Least privilege for a tenant's workers (decision 0013): a login role that reads and
//! changes only its tenant's rows, through row-level security policies (migration 7).

use super::{Db, DbResult};

/// The database role of one tenant's workers. Built only from a valid tenant name, so the
/// identifiers and literals put into the statements below cannot be anything but
/// `[a-z0-9-]` and hex.
#[derive(Debug, Clone)]
pub struct TenantRole {
    tenant: String,
    password: String,
}

/// The longest namespace whose role name fits PostgreSQL's identifiers.
pub const MAX_TENANT_FOR_ROLE: usize = 63 - "conveyor-".len();

impl TenantRole {
    /// A role for `tenant` (a namespace name) with a fresh random password.
    pub fn new(tenant: &str) -> Result<TenantRole, String> {
        let valid = !tenant.is_empty()
            && tenant
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
        if !valid {
            return Err(format!("{tenant:?} is not a namespace name"));
        }
        // PostgreSQL cuts identifiers at 63 bytes: `conveyor-` leaves 54 for the name.
        if tenant.len() > MAX_TENANT_FOR_ROLE {
            return Err(format!(
                "namespace {tenant:?} is longer than the {MAX_TENANT_FOR_ROLE} characters a \
                 role name `conveyor-<namespace>` can hold"
            ));
        }
        let password = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        Ok(TenantRole {
            tenant: tenant.to_owned(),
            password,
        })
    }

    /// `conveyor-<tenant>`, the same name as its broker user.
    pub fn name(&self) -> String {
        format!("conveyor-{}", self.tenant)
    }

    pub fn password(&self) -> &str {
        &self.password
    }
}

impl Db {
    /// Creates the tenant's role (or gives it a new password): it may read the tenant's
    /// tasks and update what a worker moves (claim, heartbeat, outcome, re-queue; not their
    /// tenant, type, payload or key), read and append their audit
    /// rows, and mark the tenant's probes seen; it cannot insert or delete tasks, nor see
    /// another tenant's rows. Runs as the tables' owner, who needs CREATEROLE.
    pub async fn grant_tenant(&self, role: &TenantRole) -> DbResult<()> {
        let name = role.name();
        let tenant = &role.tenant;
        let password = &role.password;
        let mut tx = self.maintenance.begin().await?;
        let statements = [
            format!(
                "DO $$ BEGIN
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN
                     CREATE ROLE \"{name}\" LOGIN;
                   END IF;
                 END $$"
            ),
            format!("ALTER ROLE \"{name}\" LOGIN PASSWORD '{password}'"),
            format!("GRANT USAGE ON SCHEMA public TO \"{name}\""),
            // Only the columns a worker moves; never tenant, task_type, payload or key.
            format!(
                "GRANT SELECT, UPDATE (state, attempt, retries, owner, heartbeat_at, result, \
                 error, updated_at, suspect) ON tasks TO \"{name}\""
            ),
            format!("GRANT SELECT, INSERT ON task_events TO \"{name}\""),
            format!("GRANT USAGE ON SEQUENCE task_events_seq_seq TO \"{name}\""),
            format!("GRANT SELECT, UPDATE ON queue_probes TO \"{name}\""),
            format!("DROP POLICY IF EXISTS \"{name}\" ON tasks"),
            format!(
                "CREATE POLICY \"{name}\" ON tasks TO \"{name}\"
                 USING (tenant = '{tenant}') WITH CHECK (tenant = '{tenant}')"
            ),
            format!("DROP POLICY IF EXISTS \"{name}\" ON task_events"),
            format!(
                "CREATE POLICY \"{name}\" ON task_events TO \"{name}\"
                 USING (EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))
                 WITH CHECK (EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))"
            ),
            format!("DROP POLICY IF EXISTS \"{name}\" ON queue_probes"),
            format!(
                "CREATE POLICY \"{name}\" ON queue_probes TO \"{name}\"
                 USING (task_type LIKE '{tenant}.%') WITH CHECK (task_type LIKE '{tenant}.%')"
            ),
        ];
        for statement in statements {
            sqlx::query(&statement).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
