// A minimal MCP server on stdio (newline-delimited JSON-RPC) with one tool, `list_dir`, for
// the agent clients under test. Its one argument is an enum, so a model forced to call it by
// constrained decoding writes a short, always-valid call. Every call, with what it returned,
// is appended as a JSON line to the file named by PROBE_LOG, so a test can check that the
// tool really ran and that its output went back to the model.
import { appendFileSync, readdirSync } from 'node:fs'
import { createInterface } from 'node:readline'

const TOOL = {
  name: 'list_dir',
  description: 'List the files in the working directory.',
  inputSchema: {
    type: 'object',
    properties: { path: { type: 'string', enum: ['.'], description: 'Always ".".' } },
    required: ['path'],
    additionalProperties: false,
  },
}

function reply(id, result) {
  process.stdout.write(JSON.stringify({ jsonrpc: '2.0', id, result }) + '\n')
}

function fail(id, code, message) {
  process.stdout.write(JSON.stringify({ jsonrpc: '2.0', id, error: { code, message } }) + '\n')
}

function call(params) {
  const args = params.arguments ?? {}
  let text = `unknown tool ${params.name}`
  if (params.name === TOOL.name) {
    text = readdirSync(process.cwd()).sort().join('\n') || '(empty)'
  }
  if (process.env.PROBE_LOG) {
    const line = { tool: params.name, arguments: args, output: text }
    appendFileSync(process.env.PROBE_LOG, JSON.stringify(line) + '\n')
  }
  return { content: [{ type: 'text', text }], isError: params.name !== TOOL.name }
}

createInterface({ input: process.stdin }).on('line', (line) => {
  if (!line.trim()) return
  let msg
  try {
    msg = JSON.parse(line)
  } catch {
    return fail(null, -32700, 'parse error')
  }
  if (msg.id === undefined) return // a notification (initialized, cancelled): no answer
  switch (msg.method) {
    case 'initialize':
      return reply(msg.id, {
        protocolVersion: msg.params?.protocolVersion ?? '2025-06-18',
        capabilities: { tools: {} },
        serverInfo: { name: 'probe', version: '1.0.0' },
      })
    case 'ping':
      return reply(msg.id, {})
    case 'tools/list':
      return reply(msg.id, { tools: [TOOL] })
    case 'tools/call':
      return reply(msg.id, call(msg.params ?? {}))
    default:
      return fail(msg.id, -32601, `method not found: ${msg.method}`)
  }
})
