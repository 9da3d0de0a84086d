// Renders an ollama Modelfile TEMPLATE with Go's text/template, the engine ollama renders it with, on the data ollama
// gives a chat request's template (.Messages, each with .Role and .Content): reads {"template": ..., "messages": [...]}
// as JSON on stdin, prints the prompt. tests/unit/test_gguf_export.py runs it with `go run` where Go is installed.
package main

import (
	"encoding/json"
	"os"
	"text/template"
)

type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

type Request struct {
	Template string    `json:"template"`
	Messages []Message `json:"messages"`
}

func main() {
	var request Request
	if err := json.NewDecoder(os.Stdin).Decode(&request); err != nil {
		panic(err)
	}
	tmpl := template.Must(template.New("modelfile").Parse(request.Template))
	data := map[string]any{"Messages": request.Messages}
	if err := tmpl.Execute(os.Stdout, data); err != nil {
		panic(err)
	}
}
