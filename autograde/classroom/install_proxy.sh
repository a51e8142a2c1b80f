#!/bin/sh
# configurable-http-proxy (JupyterHub's proxy, from npm) into the project's .state/node/, which
# autograde/classroom/jupyterhub_config.py and the tests use when present. Needs Node >= 18 and npm.
# On a real server you may instead install it for everyone: npm install -g configurable-http-proxy
set -e
cd "$(dirname "$0")/../.."
npm install --prefix .state/node --no-audit --no-fund --loglevel=error configurable-http-proxy@4
.state/node/node_modules/.bin/configurable-http-proxy --version
