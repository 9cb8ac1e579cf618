// Conveyor console: plain DOM over the /v1 API, no dependencies. Everything the API returns
// (payloads, labels, errors) is untrusted and reaches the page only as text nodes.
'use strict';

(() => {
  const TOKEN_KEY = 'conveyor.token';
  const API = '../v1/'; // relative to /console/, so a path prefix in front of the gateway works
  const WAITING = new Set(['INGESTED', 'QUEUED']); // cancellable
  const RESTING = new Set(['COMPLETED', 'DEAD_LETTER', 'CANCELLED']); // nothing more happens
  const BAD = new Set(['FAILED', 'DEAD_LETTER']);
  const CREATED = { '15m': 15 * 60e3, '1h': 60 * 60e3, '24h': 24 * 60 * 60e3 };
  const PAGE = 50;
  const TYPES_EVERY = 5000;

  const $ = (selector) => document.querySelector(selector);

  let token = sessionStorage.getItem(TOKEN_KEY) || '';
  let generation = 0; // bumped on every navigation: answers for an older view are dropped
  let typesTimer = 0;
  let taskTimer = 0;
  let maxRetries = new Map(); // "namespace/name" → the type's retry budget
  let list = null; // { filters, createdAfter, cursor, shown }
  let shownTask = null; // { id, state, rendered: {…} }
  let pendingAction = null; // what the user just did to the shown task

  // ---- DOM helpers -------------------------------------------------------------------

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (key === 'class') node.className = value;
      else if (key === 'text') node.textContent = value;
      else if (key === 'dataset') Object.assign(node.dataset, value);
      else node.setAttribute(key, value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }

  function badge(state) {
    return el('span', { class: `badge s-${String(state).toLowerCase()}`, text: state });
  }

  function labelChips(labels) {
    const entries = Object.entries(labels || {});
    if (!entries.length) return el('span', { class: 'muted', text: '—' });
    const box = el('span', { class: 'chips' });
    for (const [k, v] of entries) box.append(el('span', { class: 'chip', text: `${k}=${v}` }));
    return box;
  }

  function labelText(labels) {
    return Object.entries(labels || {}).map(([k, v]) => `${k}=${v}`).join(', ');
  }

  const pad = (n, w = 2) => String(n).padStart(w, '0');

  // Local time: "14:03:12" today, "2024-05-02 14:03" before; the full instant in a title.
  function timeText(iso, precise) {
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return String(iso);
    const clock = `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
    const now = new Date();
    const today = d.toDateString() === now.toDateString();
    const date = `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())}`;
    if (precise) return `${today ? '' : date + ' '}${clock}.${pad(d.getMilliseconds(), 3)}`;
    return today ? clock : `${date} ${clock.slice(0, 5)}`;
  }

  function timeCell(iso, precise) {
    return el('time', { datetime: iso, title: iso, text: timeText(iso, precise) });
  }

  // Ids are UUIDv7: those made in the same minute share their first characters, so the
  // short form is the random tail.
  function shortId(id) {
    return `…${String(id).slice(-8)}`;
  }

  function show(view) {
    for (const id of ['signin-view', 'list-view', 'task-view']) $('#' + id).hidden = id !== view;
    $('#nav').hidden = view === 'signin-view';
  }

  function showError(message) {
    $('#banner-text').textContent = message;
    $('#banner').hidden = false;
  }

  function clearError() {
    $('#banner').hidden = true;
    $('#banner-text').textContent = '';
  }

  function outcome(node, text, kind) {
    node.textContent = text;
    node.className = `outcome ${kind || ''}`;
    node.hidden = !text;
  }

  // ---- the API ---------------------------------------------------------------------

  class ApiFailure extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  async function api(method, path, body) {
    const init = {
      method,
      cache: 'no-store',
      headers: { Authorization: `Bearer ${token}`, Accept: 'application/json' },
    };
    if (body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let response;
    try {
      response = await fetch(API + path, init);
    } catch (err) {
      throw new ApiFailure(0, 'network', `Cannot reach the gateway (${err.message}).`);
    }
    const text = await response.text();
    let data = null;
    try {
      data = text ? JSON.parse(text) : null;
    } catch (_) {
      data = null;
    }
    if (!response.ok) {
      const error = data && data.error;
      const message = error && error.message
        ? error.message
        : `HTTP ${response.status} ${response.statusText}`.trim();
      const failure = new ApiFailure(response.status, (error && error.code) || 'http', message);
      if (response.status === 401) signOut(`The token was refused: ${message}`);
      throw failure;
    }
    return data;
  }

  // ---- sign in / out ---------------------------------------------------------------

  function signOut(message) {
    token = '';
    sessionStorage.removeItem(TOKEN_KEY);
    generation += 1;
    stopTimers();
    for (const body of document.querySelectorAll('tbody')) body.replaceChildren();
    for (const id of ['#task-payload', '#task-result', '#task-fields']) $(id).replaceChildren();
    resetTypeSelect(); // the next client may see other types
    clearError();
    show('signin-view');
    const error = $('#signin-error');
    error.textContent = message || '';
    error.hidden = !message;
    $('#token').value = '';
    $('#token').focus();
  }

  async function signIn(event) {
    event.preventDefault();
    const candidate = $('#token').value.trim();
    if (!candidate) return;
    const button = $('#sign-in');
    button.disabled = true;
    $('#signin-error').hidden = true;
    token = candidate;
    try {
      await api('GET', 'task-types');
    } catch (err) {
      if (err.status === 401) {
        button.disabled = false;
        return; // signOut showed why
      }
      // Any other failure says nothing against the token: go on and show it there.
    }
    button.disabled = false;
    sessionStorage.setItem(TOKEN_KEY, token);
    $('#token').value = '';
    route();
  }

  // ---- routing ---------------------------------------------------------------------

  function stopTimers() {
    clearInterval(typesTimer);
    clearTimeout(taskTimer);
    typesTimer = 0;
    taskTimer = 0;
  }

  function parseFilters(query) {
    const q = new URLSearchParams(query);
    const get = (key) => (q.get(key) || '').trim();
    const created = get('created');
    return {
      type: get('type'),
      ns: get('ns'),
      state: get('state'),
      labels: get('labels'),
      created: CREATED[created] ? created : '',
    };
  }

  function filtersHash(f) {
    const q = new URLSearchParams();
    for (const key of ['type', 'ns', 'state', 'labels', 'created']) if (f[key]) q.set(key, f[key]);
    const query = q.toString();
    return query ? `#tasks?${query}` : '#tasks';
  }

  function route() {
    generation += 1;
    stopTimers();
    clearError();
    if (!token) {
      signOut('');
      return;
    }
    const hash = location.hash.slice(1);
    if (hash.startsWith('task/')) {
      let id = hash.slice(5);
      try {
        id = decodeURIComponent(id);
      } catch (_) {
        // a hand-made URL: use it as it is, and let the API say it is no task
      }
      openTask(id);
    } else {
      const query = hash.includes('?') ? hash.slice(hash.indexOf('?') + 1) : '';
      openList(parseFilters(query));
    }
  }

  function navigate(hash) {
    if (location.hash === hash) route();
    else location.hash = hash;
  }

  // ---- task types at a glance ------------------------------------------------------

  function typeKey(ns, name) {
    return `${ns}/${name}`;
  }

  async function refreshTypes() {
    const gen = generation;
    if (document.hidden) return;
    let answer;
    try {
      answer = await api('GET', 'task-types');
    } catch (err) {
      if (gen === generation && err.status !== 401) showError(`Task types: ${err.message}`);
      return;
    }
    if (gen !== generation) return;
    const types = answer.taskTypes || [];
    maxRetries = new Map(types.map((t) => [typeKey(t.namespace, t.name), t.maxRetries]));
    renderTypes(types);
    fillTypeSelect(types);
    const f = list && list.filters;
    const dead = f && types.find((t) => t.name === f.type && (!f.ns || t.namespace === f.ns));
    $('#dead-count').textContent = dead
      ? `${dead.deadLetters} waiting in all${dead.deadLetters > 1000 ? '; a redrive takes up to 1000 at a time' : ''}`
      : '';
    $('#types-updated').textContent = `updated ${timeText(new Date().toISOString())}, every ${TYPES_EVERY / 1000} s`;
  }

  function number(value, digits) {
    if (value === null || value === undefined) return '—';
    return digits ? Number(value).toFixed(digits) : String(value);
  }

  function renderTypes(types) {
    const body = $('#types tbody');
    const existing = new Map([...body.rows].map((row) => [row.dataset.key, row]));
    const rows = types.map((t) => {
      const key = typeKey(t.namespace, t.name);
      const row = existing.get(key) || newTypeRow(t);
      existing.delete(key);
      row.cells[2].textContent = number(t.backlog);
      row.cells[2].title = `of at most ${t.maxQueueDepth}`;
      row.cells[3].textContent = number(t.takenPerSecond, 2);
      const dead = row.cells[4].firstChild;
      dead.textContent = String(t.deadLetters);
      dead.classList.toggle('alarm', t.deadLetters > 0);
      row.dataset.deadLetters = String(t.deadLetters);
      row.cells[5].textContent = String(t.maxRetries);
      return row;
    });
    body.replaceChildren(...rows);
    if (!rows.length) {
      body.append(el('tr', {}, el('td', { colspan: '6', class: 'empty', text: 'This client has no task types.' })));
    }
  }

  function newTypeRow(t) {
    const all = filtersHash({ type: t.name, ns: t.namespace });
    const dead = filtersHash({ type: t.name, ns: t.namespace, state: 'DEAD_LETTER' });
    return el('tr', { dataset: { key: typeKey(t.namespace, t.name), type: t.name, namespace: t.namespace } },
      el('td', { class: 'trunc' }, el('a', { href: all, title: `${t.name}: all tasks` , text: t.name })),
      el('td', { class: 'trunc', text: t.namespace }),
      el('td', { class: 'num' }),
      el('td', { class: 'num' }),
      el('td', { class: 'num' }, el('a', { href: dead, class: 'dead-link', title: `${t.name}: dead letters` })),
      el('td', { class: 'num' }));
  }

  // The options are exactly the types of this answer (types come and go, clients change),
  // plus the one the URL asks for until the list says whether it exists.
  function fillTypeSelect(types) {
    const select = $('#filter-type');
    const wanted = select.value;
    const namespaces = new Set(types.map((x) => x.namespace));
    const options = types.map((t) => el('option', {
      value: typeKey(t.namespace, t.name),
      text: namespaces.size > 1 ? `${t.name} (${t.namespace})` : t.name,
    }));
    if (wanted && !options.some((o) => o.value === wanted)) {
      options.push(el('option', { value: wanted, text: wanted }));
    }
    resetTypeSelect();
    select.append(...options);
    select.value = wanted;
  }

  function resetTypeSelect() {
    const select = $('#filter-type');
    for (const option of [...select.options]) if (option.value) option.remove();
  }

  // ---- the task list ---------------------------------------------------------------

  function openList(filters) {
    show('list-view');
    document.title = 'Tasks · Conveyor';
    const select = $('#filter-type');
    const value = filters.type ? typeKey(filters.ns, filters.type) : '';
    if (value && ![...select.options].some((o) => o.value === value)) {
      select.append(el('option', { value, text: filters.type })); // until the types arrive
    }
    select.value = value;
    $('#filter-state').value = filters.state;
    $('#filter-labels').value = filters.labels;
    $('#filter-created').value = filters.created;

    const dead = filters.state === 'DEAD_LETTER' && filters.type;
    $('#dead-letters').hidden = !dead;
    if (dead) {
      $('#dead-type').textContent = filters.type;
      $('#dead-count').textContent = '';
      $('#redrive-labels').value = filters.labels;
      outcome($('#redrive-result'), '');
    }
    refreshTypes();
    typesTimer = setInterval(refreshTypes, TYPES_EVERY);
    const after = CREATED[filters.created];
    list = {
      filters,
      createdAfter: after ? new Date(Date.now() - after).toISOString() : '',
      cursor: null,
      shown: 0,
    };
    $('#tasks tbody').replaceChildren();
    loadTasks(false);
  }

  function readFilters() {
    const type = $('#filter-type').value;
    const slash = type.indexOf('/');
    return {
      ns: slash >= 0 ? type.slice(0, slash) : '',
      type: slash >= 0 ? type.slice(slash + 1) : type,
      state: $('#filter-state').value,
      labels: $('#filter-labels').value.trim(),
      created: $('#filter-created').value,
    };
  }

  async function loadTasks(older) {
    const gen = generation;
    const f = list.filters;
    const q = new URLSearchParams();
    if (f.type) q.set('type', f.type);
    if (f.ns) q.set('namespace', f.ns);
    if (f.state) q.set('state', f.state);
    if (f.labels) q.set('labelSelector', f.labels);
    if (list.createdAfter) q.set('createdAfter', list.createdAfter);
    q.set('limit', String(PAGE));
    if (older && list.cursor) q.set('cursor', list.cursor);
    const status = $('#list-status');
    const olderButton = $('#older');
    const table = $('#tasks');
    olderButton.disabled = true;
    status.textContent = 'Loading…';
    table.setAttribute('aria-busy', 'true');
    let page;
    try {
      page = await api('GET', `tasks?${q}`);
    } catch (err) {
      if (gen !== generation) return;
      loaded(table);
      status.textContent = 'The tasks could not be listed.';
      olderButton.disabled = false;
      if (err.status !== 401) showError(err.message);
      return;
    }
    if (gen !== generation) return;
    loaded(table);
    const body = $('#tasks tbody');
    for (const task of page.tasks || []) body.append(taskRow(task));
    list.shown += (page.tasks || []).length;
    list.cursor = page.nextCursor || null;
    olderButton.hidden = !list.cursor;
    olderButton.disabled = false;
    if (!list.shown) {
      status.textContent = '';
      // A filter no index serves reads the history a part at a time: an empty page with a
      // cursor means none in the part read so far.
      const text = list.cursor
        ? 'None in the newest part of the history read so far; older tasks may match.'
        : 'No tasks match these filters.';
      body.append(el('tr', { class: 'none' }, el('td', { colspan: '7', class: 'empty', text })));
    } else {
      const plural = list.shown === 1 ? 'task' : 'tasks';
      status.textContent = `${list.shown} ${plural}, newest first${list.cursor ? '; older ones on the next page' : ''}.`;
    }
  }

  // Marks a finished load (answer or error) for whoever waits on the list: a counter, so
  // that a reload of the same rows is told apart from the rows before it.
  function loaded(table) {
    table.setAttribute('aria-busy', 'false');
    table.dataset.loads = String(Number(table.dataset.loads || 0) + 1);
  }

  function taskRow(t) {
    const budget = maxRetries.get(typeKey(t.namespace, t.taskType));
    const used = budget === undefined ? `${t.retries} retries used` : `${t.retries} of ${budget} retries used`;
    const labels = labelText(t.labels);
    return el('tr', { class: 'clickable', dataset: { id: t.id, state: t.state } },
      el('td', { class: 'trunc mono' }, el('a', { href: `#task/${encodeURIComponent(t.id)}`, title: t.id, text: shortId(t.id) })),
      el('td', {}, badge(t.state), t.suspect ? el('span', { class: 'flag', title: 'suspect: runs alone next time', text: '!' }) : null),
      el('td', { class: 'trunc', title: `${t.taskType} (${t.namespace})`, text: t.taskType }),
      el('td', { class: 'trunc', title: labels }, labelChips(t.labels)),
      el('td', { class: 'trunc', title: `attempt ${t.attempt}, ${used}`, text: `${t.attempt} / ${t.retries}` }),
      el('td', { class: 'trunc err', title: t.error || '', text: t.error || '' }),
      el('td', { class: 'trunc' }, timeCell(t.updatedAt)));
  }

  function openRow(event) {
    const row = event.target.closest('tr[data-id]');
    if (!row || event.target.closest('a')) return;
    location.hash = `#task/${encodeURIComponent(row.dataset.id)}`;
  }

  // ---- dead letters: redrive -------------------------------------------------------

  async function redrive(event) {
    event.preventDefault();
    const f = list && list.filters;
    if (!f || !f.type) return;
    const selector = $('#redrive-labels').value.trim();
    const which = selector ? ` whose labels match "${selector}"` : '';
    const question = `Redrive the dead letters of ${f.type}${which}?\n\n`
      + 'Up to 1000 of them go back to work, each with a fresh retry budget.';
    if (!window.confirm(question)) return;
    const button = $('#redrive');
    const result = $('#redrive-result');
    button.disabled = true;
    outcome(result, 'Redriving…');
    const body = { taskType: f.type };
    if (f.ns) body.namespace = f.ns;
    if (selector) body.labelSelector = selector;
    try {
      const answer = await api('POST', 'tasks:redrive', body);
      let text = `Redriven: ${answer.redriven}. Skipped (no longer dead): ${answer.skipped}.`;
      text += answer.more ? ' More dead letters match: redrive again.' : ' No more match.';
      if (answer.error) text += ` Stopped early: ${answer.error.message}`;
      outcome(result, text, answer.error ? 'bad' : 'good');
      result.dataset.redriven = String(answer.redriven);
      result.dataset.more = String(answer.more);
      // The list below is stale now: reload it (and the counts) but keep this answer.
      generation += 1;
      refreshTypes();
      list.cursor = null;
      list.shown = 0;
      $('#tasks tbody').replaceChildren();
      loadTasks(false);
    } catch (err) {
      outcome(result, `Not redriven: ${err.message}`, 'bad');
      if (err.status !== 401) showError(err.message);
    } finally {
      button.disabled = false;
    }
  }

  // ---- one task --------------------------------------------------------------------

  function openTask(id) {
    show('task-view');
    document.title = `Task ${shortId(id)} · Conveyor`;
    $('#task-id').textContent = id;
    const state = $('#task-state');
    state.textContent = '…';
    state.className = 'badge';
    delete state.dataset.state;
    $('#retry').hidden = true;
    $('#cancel').hidden = true;
    if (!shownTask || shownTask.id !== id) {
      pendingAction = null;
      outcome($('#action-result'), '');
    }
    shownTask = { id, state: null, rendered: {} };
    for (const sel of ['#task-fields', '#task-payload', '#task-result', '#timeline tbody']) $(sel).replaceChildren();
    loadTask(id, generation, 0);
  }

  async function loadTask(id, gen, polls) {
    clearTimeout(taskTimer);
    let task;
    let events;
    try {
      const path = `tasks/${encodeURIComponent(id)}`;
      [task, events] = await Promise.all([api('GET', path), api('GET', `${path}/events`)]);
    } catch (err) {
      if (gen !== generation) return;
      if (err.status !== 401) showError(err.message);
      if (err.status === 0 || err.status >= 500) {
        taskTimer = setTimeout(() => loadTask(id, gen, polls + 1), 3000);
      }
      return;
    }
    if (gen !== generation) return;
    renderTask(task);
    renderTimeline(events.events || []);
    if (!RESTING.has(task.state)) {
      // Every second while it moves; a task waiting long in a queue is polled less often.
      const wait = polls < 60 ? 1000 : 5000;
      taskTimer = setTimeout(() => loadTask(id, gen, polls + 1), wait);
    } else if (pendingAction) {
      const result = $('#action-result');
      outcome(result, `${pendingAction} The task is now ${task.state}.`, task.state === 'COMPLETED' || task.state === 'CANCELLED' ? 'good' : 'bad');
      pendingAction = null;
    }
  }

  function json(value) {
    if (value === undefined || value === null) return '—';
    return JSON.stringify(value, null, 2);
  }

  // Replaces a node's contents only when they changed, so that polling keeps a selection.
  function renderOnce(key, signature, paint) {
    if (shownTask.rendered[key] === signature) return;
    shownTask.rendered[key] = signature;
    paint();
  }

  function renderTask(t) {
    shownTask.state = t.state;
    const state = $('#task-state');
    state.textContent = t.state;
    state.className = `badge big s-${t.state.toLowerCase()}`;
    state.dataset.state = t.state;
    $('#retry').hidden = t.state !== 'DEAD_LETTER';
    $('#cancel').hidden = !WAITING.has(t.state);

    const payload = json(t.payload);
    renderOnce('payload', payload, () => { $('#task-payload').textContent = payload; });
    const result = t.result === undefined || t.result === null
      ? (t.state === 'COMPLETED' ? 'null' : 'none yet')
      : json(t.result);
    renderOnce('result', result, () => { $('#task-result').textContent = result; });

    const fields = JSON.stringify([t.state, t.attempt, t.retries, t.owner, t.error, t.updatedAt, t.suspect, t.labels, t.progress]);
    renderOnce('fields', fields, () => {
      const budget = maxRetries.get(typeKey(t.namespace, t.taskType));
      const rows = [
        ['Type', el('a', { href: filtersHash({ type: t.taskType, ns: t.namespace }), text: t.taskType })],
        ['Namespace', t.namespace],
        ['Attempt', String(t.attempt)],
        ['Retries used', budget === undefined ? String(t.retries) : `${t.retries} of ${budget}`],
        ['Worker', t.owner ? el('span', { class: 'trunc block mono', title: t.owner, text: t.owner }) : el('span', { class: 'muted', text: 'none' })],
        ['Labels', labelChips(t.labels)],
        ['Created', timeCell(t.createdAt, true)],
        ['Updated', timeCell(t.updatedAt, true)],
        ['Idempotency key', el('span', { class: 'mono', text: t.idempotencyKey })],
      ];
      // The handler's latest report: a percentage, a message, or its own JSON.
      if (t.progress != null) {
        const p = t.progress;
        const text = typeof p.percent === 'number' && Object.keys(p).length === 1 ? `${p.percent} %`
          : typeof p.message === 'string' && Object.keys(p).length === 1 ? p.message
          : JSON.stringify(p);
        rows.push(['Progress', el('span', { id: 'task-progress', class: 'wrap', text })]);
      }
      if (t.suspect) rows.push(['Suspect', 'yes: it was taken back from a worker that died, and runs alone next time']);
      if (t.error) {
        const name = t.state === 'COMPLETED' ? 'Earlier error' : 'Last error';
        rows.push([name, el('span', { class: 'err wrap', id: 'task-error', text: t.error })]);
      }
      $('#task-fields').replaceChildren(...rows.flatMap(([name, value]) => [
        el('dt', { text: name }),
        el('dd', {}, value),
      ]));
    });
  }

  function renderTimeline(events) {
    const last = events.length ? events[events.length - 1].seq : 0;
    renderOnce('timeline', `${events.length}:${last}`, () => {
      const rows = events.map((e) => {
        const kind = BAD.has(e.toState) ? 'bad' : e.toState === 'COMPLETED' ? 'good' : '';
        return el('tr', { class: kind, dataset: { seq: String(e.seq), toState: e.toState } },
          el('td', { class: 'trunc' }, timeCell(e.at, true)),
          el('td', { class: 'move' }, e.fromState ? badge(e.fromState) : el('span', { class: 'muted', text: 'new' }),
            el('span', { class: 'arrow', 'aria-label': 'to', text: ' → ' }), badge(e.toState)),
          el('td', { class: 'num', text: String(e.attempt) }),
          el('td', { class: 'trunc mono', title: e.workerId || '', text: e.workerId || '' }),
          el('td', { class: 'detail wrap', text: e.detail || '' }));
      });
      if (!rows.length) rows.push(el('tr', {}, el('td', { colspan: '5', class: 'empty', text: 'No events recorded.' })));
      $('#timeline tbody').replaceChildren(...rows);
    });
  }

  async function act(kind) {
    const id = shownTask && shownTask.id;
    if (!id) return;
    const question = kind === 'retry'
      ? `Retry task ${id}?\n\nIt goes back to its queue with a fresh retry budget.`
      : `Cancel task ${id}?\n\nIt will never run.`;
    if (!window.confirm(question)) return;
    const gen = generation;
    const buttons = [$('#retry'), $('#cancel')];
    for (const b of buttons) b.disabled = true;
    const result = $('#action-result');
    outcome(result, kind === 'retry' ? 'Retrying…' : 'Cancelling…');
    try {
      const task = await api('POST', `tasks/${encodeURIComponent(id)}:${kind}`);
      if (gen !== generation) return;
      pendingAction = kind === 'retry' ? 'Retried.' : 'Cancelled.';
      outcome(result, kind === 'retry'
        ? `Retried: the task is ${task.state} again; following it…`
        : `Cancelled: the task is ${task.state}.`, 'good');
      shownTask.rendered = {};
      renderTask(task);
    } catch (err) {
      if (gen !== generation) return;
      const verb = kind === 'retry' ? 'Not retried' : 'Not cancelled';
      outcome(result, `${verb}: ${err.message}`, 'bad');
      if (err.status !== 401) showError(`${verb}: ${err.message}`);
    } finally {
      for (const b of buttons) b.disabled = false;
    }
    if (gen === generation) loadTask(id, gen, 0);
  }

  // ---- wiring ----------------------------------------------------------------------

  function start() {
    $('#signin-form').addEventListener('submit', signIn);
    $('#sign-out').addEventListener('click', () => {
      history.replaceState(null, '', location.pathname + location.search);
      signOut('');
    });
    $('#banner-close').addEventListener('click', clearError);
    $('#filters').addEventListener('submit', (event) => {
      event.preventDefault();
      navigate(filtersHash(readFilters()));
    });
    $('#older').addEventListener('click', () => loadTasks(true));
    $('#tasks tbody').addEventListener('click', openRow);
    $('#redrive-form').addEventListener('submit', redrive);
    $('#retry').addEventListener('click', () => act('retry'));
    $('#cancel').addEventListener('click', () => act('cancel'));
    window.addEventListener('hashchange', route);
    // A link to the view already shown reloads it (no hashchange would).
    document.addEventListener('click', (event) => {
      const link = event.target.closest('a[href^="#"]');
      if (link && link.hash === location.hash && !event.defaultPrevented) {
        event.preventDefault();
        route();
      }
    });
    document.addEventListener('visibilitychange', () => {
      if (!document.hidden && typesTimer) refreshTypes();
    });
    route();
  }

  if (document.readyState === 'loading') document.addEventListener('DOMContentLoaded', start);
  else start();
})();
