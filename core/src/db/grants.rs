//! Least privilege for data: a login role per tenant for its workers, which reads and
//! changes only its tenant's rows through row-level security policies (migration 7,
//! decision 0013), and a login role for the gateway, which serves every tenant but owns
//! nothing (decision 0015).

use super::{Db, DbError, DbResult};

/// A login role and the fresh password it gets. Built only from names checked below, so
/// the identifiers and literals put into the statements cannot be anything but
/// `[a-z0-9_-]` and hex.
#[derive(Debug, Clone)]
struct Login {
    name: String,
    password: String,
}

impl Login {
    fn fresh(name: String) -> Login {
        let password = crate::secrets::random();
        Login { name, password }
    }

    /// Creates the role, or gives it the new password, and lets it into the schema, where
    /// it may create nothing (every role may on PostgreSQL 14 and older) and searches
    /// `pg_catalog` first: nothing it could make shadows what the application calls. A
    /// grant that cannot take CREATE away (run by a role that does not own `public`) fails,
    /// saying what to run, rather than hand out such a role.
    fn statements(&self) -> [String; 6] {
        let Login { name, password } = self;
        [
            format!(
                "DO $$ BEGIN
                   IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{name}') THEN
                     CREATE ROLE \"{name}\" LOGIN;
                   END IF;
                 END $$"
            ),
            format!("ALTER ROLE \"{name}\" LOGIN PASSWORD '{password}'"),
            format!("GRANT USAGE ON SCHEMA public TO \"{name}\""),
            format!("REVOKE CREATE ON SCHEMA public FROM PUBLIC, \"{name}\""),
            format!("ALTER ROLE \"{name}\" SET search_path = pg_catalog, public"),
            format!(
                "DO $$ BEGIN
                   IF has_schema_privilege('{name}', 'public', 'CREATE') THEN
                     RAISE EXCEPTION 'role {name} may still create objects in schema public \
                       (PostgreSQL 14 and older let every role): run REVOKE CREATE ON SCHEMA \
                       public FROM PUBLIC as the owner of schema public, then grant again'
                       USING ERRCODE = 'insufficient_privilege';
                   END IF;
                 END $$"
            ),
        ]
    }
}

/// The database role of one tenant's workers, `conveyor-<tenant>`.
#[derive(Debug, Clone)]
pub struct TenantRole {
    tenant: String,
    login: Login,
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
        Ok(TenantRole {
            tenant: tenant.to_owned(),
            login: Login::fresh(format!("conveyor-{tenant}")),
        })
    }

    /// `conveyor-<tenant>`, the same name as its broker user.
    pub fn name(&self) -> &str {
        &self.login.name
    }

    pub fn password(&self) -> &str {
        &self.login.password
    }
}

/// The login of a component that serves every tenant: the gateway's database role (and
/// the gateway's and operator's broker users). Names with `_`, such as the default
/// `conveyor_gateway`, are never a tenant's (a namespace cannot hold `_`); give each
/// Conveyor that shares a PostgreSQL server or broker its own.
#[derive(Debug, Clone)]
pub struct ComponentRole {
    login: Login,
}

pub const DEFAULT_GATEWAY_ROLE: &str = "conveyor_gateway";

impl ComponentRole {
    /// `name`: lower-case letters, digits and `_`, starting with a letter.
    pub fn new(name: &str) -> Result<ComponentRole, String> {
        let valid = name.len() <= 63
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(format!(
                "{name:?} is not a role name for the gateway: up to 63 lower-case letters, \
                 digits and `_`, starting with a letter"
            ));
        }
        Ok(ComponentRole {
            login: Login::fresh(name.to_owned()),
        })
    }

    pub fn name(&self) -> &str {
        &self.login.name
    }

    pub fn password(&self) -> &str {
        &self.login.password
    }
}

/// The advisory lock every grant and revoke holds for its transaction ("grants" in ASCII).
const GRANTS_LOCK: i64 = 0x6772_616e_7473;

impl Db {
    /// Creates the tenant's role (or gives it a new password): it may read the tenant's
    /// tasks and update what a worker moves (claim, heartbeat, outcome, re-queue; not their
    /// tenant, type, payload or key), read and append their audit rows (never choosing
    /// their time), and mark the tenant's probes seen; it cannot insert or delete tasks,
    /// lock a table against others, nor see another tenant's rows. Runs as the tables' owner, who needs CREATEROLE.
    pub async fn grant_tenant(&self, role: &TenantRole) -> DbResult<()> {
        let name = role.name();
        let tenant = &role.tenant;
        let grants = [
            // Only the columns a worker moves; never tenant, task_type, payload or key.
            format!(
                "GRANT SELECT, UPDATE (state, attempt, retries, owner, heartbeat_at, result, \
                 error, updated_at, suspect, progress) ON tasks TO \"{name}\""
            ),
            // An audit row's time and sequence number come from the database, and a probe
            // is only marked seen (migration 20261205000001): revoked first, for a role
            // granted the whole tables before.
            format!("REVOKE INSERT, UPDATE ON task_events, queue_probes FROM \"{name}\""),
            format!("GRANT SELECT ON task_events TO \"{name}\""),
            format!(
                "GRANT INSERT (task_id, task_type, from_state, to_state, attempt, worker_id, \
                 detail) ON task_events TO \"{name}\""
            ),
            format!("GRANT USAGE ON SEQUENCE task_events_seq_seq TO \"{name}\""),
            format!("GRANT SELECT ON task_events_kept TO \"{name}\""),
            format!("GRANT SELECT, UPDATE (seen_at) ON queue_probes TO \"{name}\""),
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
            format!("DROP POLICY IF EXISTS \"{name}\" ON task_events_kept"),
            format!(
                "CREATE POLICY \"{name}\" ON task_events_kept TO \"{name}\"
                 USING (EXISTS (SELECT 1 FROM tasks t WHERE t.id = task_id))"
            ),
            format!("DROP POLICY IF EXISTS \"{name}\" ON queue_probes"),
            format!(
                "CREATE POLICY \"{name}\" ON queue_probes TO \"{name}\"
                 USING (task_type LIKE '{tenant}.%') WITH CHECK (task_type LIKE '{tenant}.%')"
            ),
        ];
        self.run_grants(role.login.statements().into_iter().chain(grants))
            .await
    }

    /// Creates the gateway's role (or gives it a new password). It serves every tenant, so
    /// its policies admit every row; what it may not do is what the gateway never does:
    /// change or delete audit rows (the log is append-only to it), delete tasks, change the
    /// schema, its policies or roles. Upkeep makes and drops audit partitions through the
    /// functions migration 8 runs as their owner. Runs as the tables' owner, who needs
    /// CREATEROLE.
    pub async fn grant_gateway(&self, role: &ComponentRole) -> DbResult<()> {
        let name = role.name();
        let grants = [
            format!("GRANT SELECT, INSERT, UPDATE ON tasks TO \"{name}\""),
            format!("GRANT SELECT, INSERT ON task_events TO \"{name}\""),
            // The history of open tasks kept past the retention (migration 20261206000001).
            format!("GRANT SELECT ON task_events_kept TO \"{name}\""),
            format!("GRANT USAGE ON SEQUENCE task_events_seq_seq TO \"{name}\""),
            format!("GRANT SELECT, INSERT, UPDATE, DELETE ON queue_probes TO \"{name}\""),
            // To check that the schema is the one it was built for (`--no-migrate`).
            format!("GRANT SELECT ON _sqlx_migrations TO \"{name}\""),
            format!(
                "GRANT EXECUTE ON FUNCTION conveyor_ensure_event_partitions(integer, date), \
                 conveyor_drop_event_partitions(integer, date) TO \"{name}\""
            ),
        ];
        let tables = ["tasks", "task_events", "task_events_kept", "queue_probes"];
        let policies = tables.into_iter().flat_map(|table| {
            [
                format!("DROP POLICY IF EXISTS \"{name}\" ON {table}"),
                format!(
                    "CREATE POLICY \"{name}\" ON {table} TO \"{name}\" USING (true) WITH CHECK (true)"
                ),
            ]
        });
        self.run_grants(
            role.login
                .statements()
                .into_iter()
                .chain(grants)
                .chain(policies),
        )
        .await
    }

    /// Removes a tenant's role: its policies, its privileges in this database, then the
    /// role (a namespace gone, or its credentials to be withdrawn). Sessions of the role
    /// still open can do nothing from then on (privileges are checked per statement) and
    /// no new one logs in; a missing role is fine. Returns whether there was one.
    pub async fn revoke_tenant(&self, tenant: &str) -> DbResult<bool> {
        let role = TenantRole::new(tenant).map_err(DbError::Corrupt)?;
        let name = role.name();
        let exists: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_roles WHERE rolname = $1)")
                .bind(name)
                .fetch_one(&self.maintenance)
                .await?;
        if !exists {
            return Ok(false);
        }
        let statements = [
            format!("DROP POLICY IF EXISTS \"{name}\" ON tasks"),
            format!("DROP POLICY IF EXISTS \"{name}\" ON task_events"),
            format!("DROP POLICY IF EXISTS \"{name}\" ON task_events_kept"),
            format!("DROP POLICY IF EXISTS \"{name}\" ON queue_probes"),
            format!(
                "REVOKE ALL ON tasks, task_events, task_events_kept, queue_probes FROM \"{name}\""
            ),
            format!("REVOKE ALL ON SEQUENCE task_events_seq_seq FROM \"{name}\""),
            format!("REVOKE ALL ON SCHEMA public FROM \"{name}\""),
            format!("DROP ROLE \"{name}\""),
        ];
        self.run_grants(statements).await?;
        Ok(true)
    }

    /// Runs grant statements in one transaction, as the owner (the maintenance pool).
    /// Runs `statements` in one transaction, again (up to 3 times) when the server chose it
    /// as a deadlock victim: a grant's policies lock the task tables, which the data path
    /// writes at the same time in its own order.
    async fn run_grants(&self, statements: impl IntoIterator<Item = String>) -> DbResult<()> {
        let statements: Vec<String> = statements.into_iter().collect();
        let mut tries = 0;
        loop {
            tries += 1;
            match self.grants_once(&statements).await {
                Err(DbError::Cancelled(err)) if tries < 3 => {
                    tracing::warn!(error = %err, "grant was a deadlock victim; trying again");
                }
                result => return result,
            }
        }
    }

    async fn grants_once(&self, statements: &[String]) -> DbResult<()> {
        let mut tx = self.maintenance.begin().await?;
        // One grant at a time: two at once lock the same tables and catalogs in different
        // orders.
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(GRANTS_LOCK)
            .execute(&mut *tx)
            .await?;
        for statement in statements {
            sqlx::query(statement).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn role_names_are_checked_before_they_reach_sql() {
        assert_eq!(TenantRole::new("video").unwrap().name(), "conveyor-video");
        assert!(TenantRole::new("Video").is_err());
        assert!(TenantRole::new("a'b").is_err());
        assert!(TenantRole::new(&"a".repeat(MAX_TENANT_FOR_ROLE + 1)).is_err());
        assert_eq!(
            ComponentRole::new(DEFAULT_GATEWAY_ROLE).unwrap().name(),
            "conveyor_gateway"
        );
        for bad in ["", "1gateway", "conveyor-gateway", "gw\"; DROP", "Gateway"] {
            assert!(ComponentRole::new(bad).is_err(), "{bad:?}");
        }
        assert!(ComponentRole::new(&"g".repeat(64)).is_err());
        let (a, b) = (
            ComponentRole::new("g").unwrap(),
            ComponentRole::new("g").unwrap(),
        );
        assert_ne!(a.password(), b.password(), "a fresh password each time");
    }
}
